"""How the runtime reads a generated training program (train.py) for what the program may
leave out: a ``replicate`` step (only programs that wrap the model after its weights exist
define one) and the pipeline's split (the plan's, unless the program states its own)."""

from __future__ import annotations

from types import ModuleType

from torch import nn

from autopar.parallel.pipeline import chunk_ranges
from autopar.plan import Plan


def replicate(program: ModuleType, model: nn.Module, mesh, plan: Plan) -> nn.Module:
    """The program's ``replicate(model, mesh, plan)`` after the weights exist (DDP under
    ZeRO-0/1), or ``model`` as it is when the program defines none (fully_shard, applied by
    ``parallelize``, or no data parallelism)."""
    step = getattr(program, "replicate", None)
    return step(model, mesh, plan) if step is not None else model


def pipeline_spec(program: ModuleType, plan: Plan) -> dict:
    """The pipeline's split: chunks (block ranges; chunk c on pipeline rank c % pp), schedule
    and micro-batches as the plan has them, each replaced by the program's ``PIPELINE`` entry
    where it states one (a hand-edited program's own split)."""
    spec = {"chunks": [list(c) for c in chunk_ranges(plan)], "schedule": plan.schedule,
            "microbatches": plan.num_microbatches}
    spec.update(getattr(program, "PIPELINE", None) or {})
    return spec
