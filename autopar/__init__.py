"""autopar: find the fastest way to run a PyTorch model on many devices, then build it.

Public surface (see docs/architecture.md): ``capture``, ``plan``, ``sweep``, ``compile``,
``parallelize``, ``Trainer`` and ``TrainingArguments``, ``Generator``, ``pipeline``, ``Cluster``, the error classes and the ``ir`` module.
"""

import autopar.report  # noqa: F401 - registers Plan.report's renderer (plan/ cannot import it)
from autopar import ir
from autopar._version import __version__
from autopar.api import Trainer, TrainingArguments
from autopar.capture import capture
from autopar.codegen import compile_artifact as compile  # noqa: A001 - the public name
from autopar.cost.hardware import Cluster
from autopar.errors import AutoparError, CaptureError, InfeasibleError, PlanError
from autopar.plan import Plan
from autopar.search.api import plan
from autopar.search.sweep import sweep
from autopar.serve.generate import Generator
from autopar.serve.pipeline import pipeline
from autopar.train.parallelize import parallelize

__all__ = ["AutoparError", "CaptureError", "Cluster", "Generator", "InfeasibleError", "Plan",
           "PlanError", "Trainer", "TrainingArguments",
           "capture", "compile", "ir", "parallelize", "pipeline", "plan", "sweep",
           "__version__"]
