"""``autopar.parallelize``: apply a plan to your own model, in your own training loop.

For people with their own loss, data and loop (a classifier, Hugging Face's Trainer,
Lightning): build the model as usual on every rank (same seed, or load the same weights),
call :func:`parallelize` inside the torchrun script, then build the optimizer with
:func:`optimizer`. The pieces are the Trainer's: DTensor tensor and sequence parallelism,
recompute as planned, DDP or fully_shard per the plan's ZeRO stage and offload.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from autopar.errors import PlanError
from autopar.plan import Plan
from autopar.plan.support import refuse_unsupported
from autopar.plan.tp_entries import FIX
from autopar.runtime.expert_parallel import check_expert_parallel
from autopar.runtime.model_heads import heads_mismatch, output_features
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


def check_tp_entries(model: nn.Module, plan: Plan) -> None:
    """Refuse a plan whose ``placements.fused`` / ``placements.heads`` entries no longer match
    ``model`` (hand-edited, or planned for another shape), from what the modules hold, before
    any work: a fused projection's parts must add up to its output features, a heads entry
    must name an attention module of the model whose head counts and widths it agrees with.
    Otherwise tensor parallelism cuts the wrong rows and every rank fails inside the model."""
    modules = dict(model.named_modules())
    fused = plan.placements.get("fused") or {}
    for path, parts in fused.items():
        module = modules.get(path)
        if module is None:
            raise PlanError(f"the plan's placements.fused names {path}, which the model does "
                            f"not have; {FIX}")
        width = output_features(module)
        if width is not None and sum(parts) != width:
            raise PlanError(f"the plan's placements.fused[{path}] {parts} adds up to "
                            f"{sum(parts)}, but the model's {path} has {width} output "
                            f"features; {FIX}")
    for path, (q, kv, head_dim) in (plan.placements.get("heads") or {}).items():
        module = modules.get(path)
        if module is None:
            raise PlanError(f"the plan's placements.heads names {path}, which the model does "
                            f"not have; {FIX}")
        wrong = heads_mismatch(module, path, [q, kv, head_dim], fused)
        if wrong:
            raise PlanError(f"the plan's placements.heads[{path}] {[q, kv, head_dim]} does not "
                            f"match the model: {wrong}; {FIX}")


def parallelize(model: nn.Module, plan: Plan, device: str = "cpu", *,
                example: torch.Tensor | None = None, loss_fn=None) -> nn.Module | Pipeline:
    """``model`` (built and initialised on every rank, on ``device``) parallelised as ``plan``
    says, in the current process group (world size = ``plan.devices``). A fine-tuning plan's
    method (``plan.peft``) is applied first unless the model has it already.

    Without pipeline stages it returns the module to train (a DDP wrapper under ZeRO-0/1, else
    ``model`` itself); outputs stay whole, so any loss works. Tensor-parallel weights are taken
    from rank 0. With pipeline stages (pp > 1) it returns a :class:`Pipeline`: this rank's
    stages and the planned schedule; give ``example`` (one micro-batch of inputs, to trace the
    model) and ``loss_fn(output, target)``, then call ``pipeline.step(inputs, target)`` each
    step. Under expert parallelism each data-parallel rank, dp x ep of them, reads its own
    rows (``rank // tp``); with ZeRO-2/3 fully_shard reduces the expert gradients, with ZeRO-0
    DDP reduces the dense ones and the optimizer from :func:`optimizer` the experts' (over dp,
    before each step, as the Trainer does).
    """
    refuse_unsupported(plan)
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world != plan.devices:
        raise PlanError(f"the plan is for {plan.devices} devices but {world} processes are "
                        f"running; launch with torchrun --nproc-per-node {plan.devices}")
    if plan.peft:  # a fine-tuning plan: the method it was planned with, applied once
        from autopar.peft import applied_method, apply_peft

        if applied_method(model) is None:
            apply_peft(model, plan.peft)
    check_module_paths(model, plan)
    check_tp_entries(model, plan)
    from autopar.runtime.mesh import build_mesh, single_process_mesh

    if plan.mesh["pp"] > 1:
        if example is None or loss_fn is None:
            raise PlanError("the plan has pipeline stages: pass example= (one micro-batch of "
                            "inputs) and loss_fn=(output, target) to autopar.parallelize")
        return _pipeline(model, plan, device, build_mesh(plan, device), example, loss_fn)
    dp_mesh = None
    if world > 1:
        mesh = build_mesh(plan, device)
        dp_mesh = mesh["dp"]
        if plan.mesh["tp"] > 1:
            apply_tensor_parallel(model, plan, mesh["tp"], whole_logits=True)
        if plan.mesh["ep"] > 1:
            from autopar.runtime.expert_parallel import (
                apply_expert_parallel,
                shard_expert_data_parallel,
            )

            check_expert_parallel(plan)
            experts = apply_expert_parallel(model, plan, mesh["ep"])
            apply_recompute(model, plan)
            if shard_expert_data_parallel(model, plan, mesh, experts):
                return model
            return _replicate_experts(model, plan, mesh, experts)
    elif {"optimizer", "params"} & set(plan.offload):
        dp_mesh = single_process_mesh(plan, device)["dp"]
    apply_recompute(model, plan)
    if shard_data_parallel(model, plan, dp_mesh):
        return model
    return replicate_data_parallel(model, plan, dp_mesh)[0]


# the attribute of a ZeRO-0 expert-parallel model holding its expert-gradient sync, which the
# optimizer from :func:`optimizer` runs before each step
EXPERT_SYNC_ATTR = "_autopar_sync_expert_grads"


def _replicate_experts(model: nn.Module, plan: Plan, mesh, experts: list) -> nn.Module:
    """ZeRO-0 under expert parallelism, as the generated program and the Trainer run it: DDP
    over dp x ep for the dense parameters (the generated program's ``replicate``), and the
    experts' gradients summed over dp and divided by dp x ep once the step's backwards are
    done (the Trainer's :func:`sync_expert_grads`), here by the optimizer before its step."""
    from functools import partial

    from autopar.runtime.expert_parallel import replicate_expert_data_parallel, sync_expert_grads

    ddp = replicate_expert_data_parallel(model, plan, mesh, experts)
    dp_group = mesh["dp"].get_group() if plan.mesh["dp"] > 1 else None
    setattr(ddp, EXPERT_SYNC_ATTR, partial(sync_expert_grads, experts, plan, dp_group))
    return ddp


@dataclass
class Pipeline:
    """This rank's pipeline stages (``modules``, one nn.ModuleList to optimise) and the
    planned schedule, returned by :func:`parallelize` for a plan with pp > 1."""

    modules: nn.ModuleList
    schedule: object
    plan: Plan
    pp_group: object
    dp_group: object | None
    replicated: bool  # ZeRO-0/1 replicas: gradients averaged over dp after each step
    tied: dict  # tied weights' copies on several stages: gradients summed across them

    def parameters(self):
        return self.modules.parameters()

    def step(self, inputs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Forward and backward of one global batch share (every rank passes the same
        ``inputs`` and ``target`` of its data-parallel rows; the schedule cuts them into
        micro-batches); returns the mean loss on every rank. Step the optimizer after it."""
        from autopar.runtime.pipeline import all_reduce_replica_grads, sync_tied_grads

        losses: list[torch.Tensor] = []
        self.schedule.step(inputs, target=target, losses=losses)
        if self.replicated:
            all_reduce_replica_grads(list(self.modules), self.dp_group, self.plan.mesh["dp"])
        if self.tied:
            sync_tied_grads(list(self.modules), self.tied, self.pp_group)
        device = next(self.modules.parameters()).device
        total = torch.stack([loss.detach().float() for loss in losses]).mean() if losses \
            else torch.zeros((), device=device)
        dist.all_reduce(total, group=self.pp_group)  # only the last stage holds the losses
        return total


def _pipeline(model: nn.Module, plan: Plan, device: str, mesh, example: torch.Tensor,
              loss_fn) -> Pipeline:
    """Trace ``model`` (built, with weights), split it at the plan's stages, and lay each of
    this rank's stages out as the generated program does: tensor parallelism (traced
    styles), recompute, data parallelism."""
    from autopar.runtime.pipeline import build_pipeline, replicated_stages, tied_copies
    from autopar.runtime.tensor_parallel import apply_layout, tensor_parallel_layout

    tied = tied_copies(model)
    layout = tensor_parallel_layout(model, plan, traced=True) if plan.mesh["tp"] > 1 else None
    dp_mesh = mesh["dp"]

    def lay_out(stage: nn.Module) -> None:
        if layout is not None:
            apply_layout(stage, layout, mesh["tp"], original=model)
        apply_recompute(stage, plan, skip_missing=True)
        shard_data_parallel(stage, plan, dp_mesh)

    _, schedule, modules = build_pipeline(model, plan, mesh["pp"], device, example, loss_fn,
                                          lay_out)
    dp_group = dp_mesh.get_group() if plan.mesh["dp"] > 1 else None
    return Pipeline(nn.ModuleList(modules), schedule, plan, mesh["pp"].get_group(), dp_group,
                    replicated_stages(plan, dp_mesh), tied)


def optimizer(model: nn.Module | Pipeline, plan: Plan,
              cls: type[torch.optim.Optimizer] = torch.optim.AdamW,
              **kwargs) -> torch.optim.Optimizer:
    """The optimizer for a :func:`parallelize`-d model or pipeline: ``cls(params,
    **kwargs)``, with its states sharded over the data-parallel ranks
    (ZeroRedundancyOptimizer) when the plan says ZeRO-1 over replicas. For a ZeRO-0
    expert-parallel model it reduces the expert gradients before each step (after your
    backwards, gradient accumulation included): clip gradients after that, not before."""
    params = [p for p in model.parameters() if p.requires_grad]
    sync_experts = getattr(model, EXPERT_SYNC_ATTR, None)
    if sync_experts is not None:
        opt = cls(params, **kwargs)
        opt.register_step_pre_hook(lambda *_: sync_experts())
        return opt
    if isinstance(model, Pipeline) and model.replicated and plan.zero_stage == 1:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(params, cls, process_group=model.dp_group, **kwargs)
    if plan.zero_stage == 1 and isinstance(model, nn.parallel.DistributedDataParallel):
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(params, cls, process_group=model.process_group,
                                       **kwargs)
    return cls(params, **kwargs)
