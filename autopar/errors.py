"""The errors a user can act on. Each message names the cause and the fix in one line."""

from __future__ import annotations


class AutoparError(Exception):
    """Base class: a problem with the user's input, reported without a traceback by the CLI."""


class CaptureError(AutoparError):
    """The model (or ONNX file) could not be turned into autopar's IR."""


class InfeasibleError(AutoparError):
    """No plan fits the device budget; the message says which bound and the way out."""


class PlanError(AutoparError):
    """A plan file is malformed, of another version, or inconsistent with the model or world."""


class SequenceParallelUnsupported(PlanError):
    """The runtime cannot lay out sequence parallelism for this model's modules; the same plan
    without it runs (``autopar compile`` then re-plans with sequence_parallel=false)."""


class RunFailure(AutoparError):
    """A distributed run lost a process or its network; the CLI exits 1 with this line."""

    exit_code = 1
