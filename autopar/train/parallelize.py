"""``autopar.parallelize``: apply a plan to your own model, in your own training loop.

For people with their own loss, data and loop (a classifier, Hugging Face's Trainer,
Lightning): build the model as usual on every rank (same seed, or load the same weights),
call :func:`parallelize` inside the torchrun script, then build the optimizer with
:func:`optimizer`. It runs the program ``autopar run`` runs (autopar.codegen.program, rendered
in memory for your model): DTensor tensor and sequence parallelism, recompute as planned, DDP
or fully_shard per the plan's ZeRO stage and offload, the pipeline split and schedule.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType

import torch
import torch.distributed as dist
from torch import nn

from autopar.codegen.program import model_program
from autopar.errors import PlanError
from autopar.parallel.context_parallel import CP_ATTR, context_parallel_of
from autopar.parallel.cp_layout import shard_sequence
from autopar.parallel.cp_stage import trace_positions
from autopar.parallel.expert_parallel import (
    ExpertParallelExperts,
    replica_group,
    sync_expert_grads,
)
from autopar.parallel.expert_zero import ExpertZeroOptimizer
from autopar.parallel.mesh import axis, replica_axis
from autopar.parallel.model_heads import heads_mismatch, output_features
from autopar.parallel.pipeline import (
    average_replica_grads,
    build_pipeline,
    replicated_stages,
    sync_tied_grads,
    tied_copies,
)
from autopar.peft import applied_method, apply_peft
from autopar.plan import Plan
from autopar.plan.support import refuse_unsupported
from autopar.plan.tp_entries import FIX
from autopar.train.expert_capacity import (
    CapacityCounter,
    install_capacity,
    refuse_split_sequences,
)
from autopar.train.program_calls import pipeline_spec, replicate
from autopar.train.router_loss import routing_shape


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
    weights = dict(model.named_parameters())
    fused = plan.placements.get("fused") or {}
    for path, parts in fused.items():
        module = modules.get(path)
        if path in weights:  # an einsum projection's bare weight: one of its dims is the output
            if sum(parts) not in weights[path].shape:
                raise PlanError(f"the plan's placements.fused[{path}] {parts} adds up to "
                                f"{sum(parts)}, but the model's {path} is "
                                f"{list(weights[path].shape)}; {FIX}")
            continue
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

    It runs the training program ``autopar compile`` writes for the plan (train.py, rendered
    in memory for this model, the LM head's output gathered whole for your loss): its
    ``build_mesh``, ``parallelize`` and ``replicate``, or for pipelines its
    ``parallelize_stage`` on each of this rank's stages. The text it ran is the returned
    object's ``_autopar_program`` (:data:`PROGRAM_ATTR`).

    Without pipeline stages it returns the module to train (a DDP wrapper under ZeRO-0/1, else
    ``model`` itself); outputs stay whole, so any loss works. Tensor-parallel weights are taken
    from rank 0. With pipeline stages (pp > 1) it returns a :class:`Pipeline`: this rank's
    stages and the planned schedule; give ``example`` (one micro-batch of inputs, to trace the
    model) and ``loss_fn(output, target)``, then call ``pipeline.step(inputs, target)`` each
    step. Under context parallelism (cp > 1) ``example`` and the step's inputs are whole
    sequences; each cp rank runs its share, and ``loss_fn`` gets that share: a mean over its
    tokens is exact when every cp rank counts as many targets (no ignored labels), else use
    :func:`autopar.train.loss.context_parallel_lm_loss` with the pipeline's
    ``context_parallel_of(pipeline.modules)``. Under expert parallelism each data-parallel rank, dp x ep of them, reads its own
    rows (``rank // tp``); with ZeRO-2/3 fully_shard reduces the expert gradients, with
    ZeRO-0/1 DDP reduces the dense ones and the optimizer from :func:`optimizer` the experts'
    (over dp, before each step, as the Trainer does; ZeRO-1's shards its states too). A plan
    with a ``capacity_factor`` drops the token copies past each expert's capacity, as the
    Trainer does; the returned module's :data:`CAPACITY_ATTR` counts them.
    """
    refuse_unsupported(plan)
    if plan.capacity_factor is not None:
        refuse_split_sequences(plan.mesh, "without capacity_factor")
    world = dist.get_world_size() if dist.is_initialized() else 1
    plan.check_world_size(world)
    if plan.mesh["pp"] > 1 and (example is None or loss_fn is None):
        raise PlanError("the plan has pipeline stages: pass example= (one micro-batch of "
                        "inputs) and loss_fn=(output, target) to autopar.parallelize")
    if plan.peft:  # a fine-tuning plan: the method it was planned with, applied once

        if applied_method(model) is None:
            apply_peft(model, plan.peft)
    check_module_paths(model, plan)
    check_tp_entries(model, plan)

    text, program = model_program(plan, model, whole_logits=True)
    mesh = program.build_mesh(device)
    if plan.mesh["pp"] > 1:
        result = _pipeline(model, plan, device, mesh, program, example, loss_fn)
    else:
        # written for a meta model, the Trainer's; on real weights the same calls distribute
        # each rank's tensors (tensor-parallel shards from rank 0, fully_shard's from each
        # rank's own copy, offload to the host) instead of leaving them to materialize
        program.parallelize(model, mesh, plan)
        counter = _capacity(model, plan)
        result = _with_expert_sync(replicate(program, model, mesh, plan), plan, mesh)
        if counter is not None:
            setattr(result, CAPACITY_ATTR, counter)
    setattr(result, PROGRAM_ATTR, text)
    return result


def _capacity(model: nn.Module, plan: Plan) -> CapacityCounter | None:
    """The plan's expert capacity installed on the parallelized model (None: dropless)."""
    if plan.capacity_factor is None:
        return None
    return install_capacity(model, plan.capacity_factor, *routing_shape(model))


# the attribute of what :func:`parallelize` returns holding the program text it ran
PROGRAM_ATTR = "_autopar_program"
# the attribute holding the routed and dropped token copies when the plan has a capacity factor
# (a CapacityCounter: ``routed, dropped = model._autopar_capacity.take()`` after each step)
CAPACITY_ATTR = "_autopar_capacity"
# the attribute of a ZeRO-0/1 expert-parallel model holding its expert-gradient sync, which the
# optimizer from :func:`optimizer` runs before each step
EXPERT_SYNC_ATTR = "_autopar_sync_expert_grads"
# and its dp group, over which ZeRO-1 shards the experts' optimizer states
EXPERT_DP_GROUP_ATTR = "_autopar_expert_dp_group"


def _with_expert_sync(model: nn.Module, plan: Plan, mesh) -> nn.Module:
    """Under expert parallelism with ZeRO-0/1 the program's ``replicate`` leaves the experts out
    of DDP; their gradients are summed over dp and divided by dp x ep once the step's
    backwards are done (the Trainer's :func:`sync_expert_grads`), here by the optimizer
    before its step. Loop glue, not data parallelism of its own."""
    from functools import partial

    if plan.mesh["ep"] == 1 or not isinstance(model, nn.parallel.DistributedDataParallel):
        return model
    experts = [m for m in model.modules() if isinstance(m, ExpertParallelExperts)]
    dp_group = axis(mesh, "dp").group if plan.mesh["dp"] > 1 else None
    setattr(model, EXPERT_SYNC_ATTR, partial(sync_expert_grads, experts, plan, dp_group))
    setattr(model, EXPERT_DP_GROUP_ATTR, dp_group)
    return model


@dataclass
class Pipeline:
    """This rank's pipeline stages (``modules``, one nn.ModuleList to optimise) and the
    planned schedule, returned by :func:`parallelize` for a plan with pp > 1."""

    modules: nn.ModuleList
    schedule: object
    plan: Plan
    pp_group: object
    dp_group: object | None
    replicated: bool  # ZeRO-0/1 replicas: gradients averaged over dp (x ep) after each step
    tied: dict  # tied weights' copies on several stages: gradients summed across them
    replica_group: object | None = None  # dp x ep under expert parallelism
    experts: list = field(default_factory=list)  # this rank's expert-parallel experts
    # the stages' gradient replicas: dp, or dp x cp under context parallelism
    stage_replica_group: object | None = None

    def parameters(self):
        return self.modules.parameters()

    def step(self, inputs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Forward and backward of one global batch share (every rank passes the same
        ``inputs`` and ``target`` of its data-parallel rows; the schedule cuts them into
        micro-batches); returns the mean loss on every rank. Step the optimizer after it.
        Under context parallelism every cp rank passes the whole sequences too: each runs
        its share (``ContextParallel.shard``), and ``loss_fn`` gets that share of the output
        and targets (see :func:`parallelize`)."""
        losses: list[torch.Tensor] = []
        cp = context_parallel_of(self.modules)
        if cp is not None:
            inputs, target = cp.shard(inputs), cp.shard(target)
        self.schedule.step(inputs, target=target, losses=losses)
        if self.replicated:
            average_replica_grads(list(self.modules), self.plan, self.stage_replica_group,
                                  self.replica_group, self.experts)
        if self.tied:
            sync_tied_grads(list(self.modules), self.tied, self.pp_group)
        device = next(self.modules.parameters()).device
        total = torch.stack([loss.detach().float() for loss in losses]).mean() if losses \
            else torch.zeros((), device=device)
        if cp is not None:  # each cp rank's loss is its share of the sequence's
            total = cp.mean(total)
        dist.all_reduce(total, group=self.pp_group)  # only the last stage holds the losses
        return total


def _pipeline(model: nn.Module, plan: Plan, device: str, mesh, program: ModuleType,
              example: torch.Tensor, loss_fn) -> Pipeline:
    """Trace ``model`` (built, with weights), split it at the program's chunks, and lay each
    of this rank's stages out with the program's ``parallelize_stage``, as the Trainer
    does (there on meta)."""
    tied = tied_copies(model)
    spec = pipeline_spec(program, plan)

    def lay_out(stage: nn.Module) -> None:
        program.parallelize_stage(stage, mesh, plan, model)

    inputs = None
    cp = axis(mesh, "cp")
    if cp.size > 1:  # traced on this cp rank's share, its positions an input
        example = shard_sequence(example, cp.local_rank, cp.size, 1)
        inputs = trace_positions(model, example.shape[0], example.shape[1])
    _, schedule, modules = build_pipeline(
        model, plan, axis(mesh, "pp").mesh, device, example, loss_fn, lay_out,
        chunks=[tuple(c) for c in spec["chunks"]], schedule=spec["schedule"],
        microbatches=spec["microbatches"], inputs=inputs)
    dp_group = axis(mesh, "dp").group if plan.mesh["dp"] > 1 else None
    replicas = replica_axis(mesh, plan)
    stages = nn.ModuleList(modules)
    cps = [c for c in map(context_parallel_of, modules) if c is not None]
    if cps:
        setattr(stages, CP_ATTR, cps[0])
    experts = [m for s in modules for m in s.modules() if isinstance(m, ExpertParallelExperts)]
    return Pipeline(stages, schedule, plan, axis(mesh, "pp").group, dp_group,
                    replicated_stages(plan, replicas.mesh), tied,
                    replica_group(plan, mesh, dp_group), experts, replicas.group)


def optimizer(model: nn.Module | Pipeline, plan: Plan,
              cls: type[torch.optim.Optimizer] = torch.optim.AdamW,
              **kwargs) -> torch.optim.Optimizer:
    """The optimizer for a :func:`parallelize`-d model or pipeline: ``cls(params,
    **kwargs)``, with its states sharded over the data-parallel ranks
    (ZeroRedundancyOptimizer) when the plan says ZeRO-1 over replicas; under expert
    parallelism, the dense parameters' over dp x ep and the experts' over dp
    (:class:`~autopar.parallel.expert_zero.ExpertZeroOptimizer`). For a ZeRO-0/1
    expert-parallel model it reduces the expert gradients before each step (after your
    backwards, gradient accumulation included): clip gradients after that, not before."""
    params = [p for p in model.parameters() if p.requires_grad]
    sync_experts = getattr(model, EXPERT_SYNC_ATTR, None)
    if sync_experts is not None:
        opt = ExpertZeroOptimizer(params, cls, model.process_group,
                                  getattr(model, EXPERT_DP_GROUP_ATTR), **kwargs) \
            if plan.zero_stage == 1 else cls(params, **kwargs)
        opt.register_step_pre_hook(lambda *_: sync_experts())
        return opt
    if isinstance(model, Pipeline) and model.replicated and plan.zero_stage == 1 and \
            plan.mesh["ep"] > 1:  # the pipeline synchronised the gradients in its step
        return ExpertZeroOptimizer(params, cls, model.replica_group, model.dp_group, **kwargs)
    if isinstance(model, Pipeline) and model.replicated and plan.zero_stage == 1:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(params, cls, process_group=model.stage_replica_group,
                                       **kwargs)
    if plan.zero_stage == 1 and isinstance(model, nn.parallel.DistributedDataParallel):
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(params, cls, process_group=model.process_group,
                                       **kwargs)
    return cls(params, **kwargs)
