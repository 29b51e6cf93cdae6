"""A toy parallelism's runtime: the last layer this rank holds keeps its parameters gathered
after its forward (FSDP2's ``set_reshard_after_forward``), called by the generated program
after ``fully_shard``."""

from __future__ import annotations

from torch import nn

from autopar.parallel.program_steps import layers
from autopar.plan import Plan


def apply(model: nn.Module, mesh, plan: Plan, keep: bool) -> None:
    """Keep ``model``'s last layer gathered from its forward to its backward when ``keep``."""
    if keep:
        model.get_submodule(layers(model, plan)[-1]).set_reshard_after_forward(False)
