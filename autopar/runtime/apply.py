"""``autopar.parallelize``: apply a plan to your own model, in your own training loop.

For people with their own loss, data and loop (a classifier, Hugging Face's Trainer,
Lightning): build the model as usual on every rank (same seed, or load the same weights),
call :func:`parallelize` inside the torchrun script, then build the optimizer with
:func:`optimizer`. The pieces are the Trainer's: DTensor tensor and sequence parallelism,
recompute as planned, DDP or fully_shard per the plan's ZeRO stage and offload.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from autopar.errors import PlanError
from autopar.plan import Plan
from autopar.plan.support import refuse_unsupported
from autopar.runtime.parallelize import (
    apply_recompute,
    replicate_data_parallel,
    shard_data_parallel,
)
from autopar.runtime.tensor_parallel import apply_tensor_parallel


def check_module_paths(model: nn.Module, plan: Plan) -> None:
    """Refuse a plan that names parameters the model does not have (planned for another model,
    or edited): they would otherwise be silently left replicated."""
    have = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    missing = sorted(set(plan.placements.get("params", {})) - have)
    if missing:
        raise PlanError(f"the plan places {len(missing)} parameters the model does not have "
                        f"(e.g. {missing[0]}); it was planned for another model: plan this "
                        f"one (autopar compile, or autopar.plan)")


def parallelize(model: nn.Module, plan: Plan, device: str = "cpu") -> nn.Module:
    """``model`` (built and initialised on every rank, on ``device``) parallelised as ``plan``
    says, in the current process group (world size = ``plan.devices``); returns the module to
    train (a DDP wrapper under ZeRO-0/1, else ``model`` itself). Outputs stay whole, so any
    loss works. Tensor-parallel weights are taken from rank 0.

    Pipelines and expert parallelism are not applied here yet: a plan with pp > 1 or ep > 1 is
    refused (re-plan with constraints pp=1,ep=1).
    """
    refuse_unsupported(plan)
    if plan.mesh["pp"] > 1 or plan.mesh["ep"] > 1:
        raise PlanError("autopar.parallelize does not apply pipelines or expert parallelism "
                        "yet; re-plan with constraints pp=1,ep=1 (or train with autopar run)")
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world != plan.devices:
        raise PlanError(f"the plan is for {plan.devices} devices but {world} processes are "
                        f"running; launch with torchrun --nproc-per-node {plan.devices}")
    check_module_paths(model, plan)
    from autopar.runtime.mesh import build_mesh, single_process_mesh

    dp_mesh = None
    if world > 1:
        mesh = build_mesh(plan, device)
        dp_mesh = mesh["dp"]
        if plan.mesh["tp"] > 1:
            apply_tensor_parallel(model, plan, mesh["tp"], whole_logits=True)
    elif {"optimizer", "params"} & set(plan.offload):
        dp_mesh = single_process_mesh(plan, device)["dp"]
    apply_recompute(model, plan)
    if shard_data_parallel(model, plan, dp_mesh):
        return model
    return replicate_data_parallel(model, plan, dp_mesh)[0]


def optimizer(model: nn.Module, plan: Plan, cls: type[torch.optim.Optimizer] = torch.optim.AdamW,
              **kwargs) -> torch.optim.Optimizer:
    """The optimizer for a :func:`parallelize`-d model: ``cls(params, **kwargs)``, with its
    states sharded over the data-parallel ranks (ZeroRedundancyOptimizer) when the plan says
    ZeRO-1 and the model is DDP-replicated."""
    params = [p for p in model.parameters() if p.requires_grad]
    if plan.zero_stage == 1 and isinstance(model, nn.parallel.DistributedDataParallel):
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(params, cls, process_group=model.process_group,
                                       **kwargs)
    return cls(params, **kwargs)
