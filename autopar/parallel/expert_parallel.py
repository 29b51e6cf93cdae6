"""Expert parallelism: each ep rank holds num_experts / ep experts, and token copies travel to
the rank owning their expert by all-to-all and back.

Layout (the one the cost model prices, ``autopar/cost/estimate.py``): the mesh is
("pp", "dp", "ep", "tp"); the ``dp x ep`` ranks read different rows of the global batch; dense
parameters are replicated over ``dp x ep`` and their gradients averaged there; expert parameters
are DTensors split on dim 0 over ``ep`` and their gradients reduced over ``dp`` only. ZeRO shards
dense parameters over ``dp x ep`` and expert parameters over ``dp``.
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from autopar.errors import PlanError
from autopar.parallel.comm import all_to_all, exchange_counts
from autopar.parallel.policies import _has_accelerator, _layer_names, mixed_precision_policy
from autopar.plan import Plan

# the forward of a transformers 5 experts module (and of its expert-parallel drop-in)
EXPERTS_SIGNATURE = ["hidden_states", "top_k_index", "top_k_weights"]


def _num_experts(model: nn.Module, module: nn.Module) -> int | None:
    n = getattr(module, "num_experts", None)
    if isinstance(n, int):
        return n
    cfg = getattr(model, "config", None)
    for key in ("num_local_experts", "num_experts", "n_routed_experts"):
        if isinstance(getattr(cfg, key, None), int):
            return getattr(cfg, key)
    return None


def find_experts(model: nn.Module) -> list[str]:
    """Paths of the expert modules: modules whose parameters are stacked per expert (3-D,
    first dim = number of experts), as in transformers 5 MoE models. Expert modules this
    runtime cannot split (an ``nn.ModuleList`` of experts, a different forward) raise."""
    found = []
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(module, nn.ModuleList) and "expert" in leaf:
            raise PlanError(f"{name} holds its experts as an nn.ModuleList; expert parallelism "
                            f"needs experts stacked in 3-D parameters (transformers >= 5 "
                            f"models); re-plan with ep=1")
        num = _num_experts(model, module)
        own = dict(module.named_parameters(recurse=False))
        # a module that says it holds experts, or is named so, with a per-expert 3-D stack
        if num is None or not (hasattr(module, "num_experts") or "expert" in leaf) or \
                not any(p.dim() == 3 and p.shape[0] == num for p in own.values()):
            continue
        odd = [n for n, p in own.items() if p.dim() < 2 or p.shape[0] != num]
        if odd or sum(1 for _ in module.parameters()) != len(own):
            raise PlanError(f"expert module {name} holds parameters not stacked per expert "
                            f"({', '.join(odd) or 'in submodules'}); expert parallelism cannot "
                            f"split it; re-plan with ep=1")
        signature = list(inspect.signature(module.forward).parameters)
        if signature != EXPERTS_SIGNATURE:
            raise PlanError(f"expert module {name} has forward({', '.join(signature)}), not "
                            f"forward({', '.join(EXPERTS_SIGNATURE)}) as transformers 5 MoE "
                            f"experts do; re-plan with ep=1")
        found.append(name)
    return found


class ExpertParallelExperts(nn.Module):
    """Drop-in for a transformers 5 experts module under expert parallelism.

    Holds this rank's experts as DTensors split on dim 0 over the ep mesh, under the original
    parameter names (checkpoints keep their keys and load under any plan). The forward sorts
    the token copies by expert, exchanges counts, sends each copy to the rank owning its
    expert, runs the original module's own expert computation on the local experts, sends
    the results back and combines them with the top-k weights.
    """

    def __init__(self, experts: nn.Module, ep_mesh: DeviceMesh, num_experts: int) -> None:
        super().__init__()
        ep = ep_mesh.size()
        if num_experts % ep:
            raise PlanError(f"{num_experts} experts cannot be split over ep={ep}; re-plan with "
                            f"an ep that divides {num_experts}")
        self.num_experts, self.num_local, self.ep = num_experts, num_experts // ep, ep
        self.group = ep_mesh.get_group()
        first = ep_mesh.get_local_rank() * self.num_local
        for name, full in list(experts.named_parameters(recurse=False)):
            local = full.detach()[first:first + self.num_local].clone()
            shard = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False)
            self.register_parameter(name, nn.Parameter(shard, requires_grad=full.requires_grad))
            delattr(experts, name)
        experts.num_experts = self.num_local
        # the original module computes the local experts; it is not a submodule because its
        # parameters now live here (under the same names)
        object.__setattr__(self, "_compute", experts)
        self.tokens_sent: list[int] = []
        self.tokens_received: list[int] = []
        # set before each forward by expert capacity (autopar.train.expert_capacity): which
        # token copies their expert keeps; the others are not sent at all
        self.kept: torch.Tensor | None = None

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        tokens, k = top_k_index.shape
        flat = top_k_index.reshape(-1)
        kept, self.kept = self.kept, None
        if kept is not None:  # dropped copies sort last, past every expert's count
            flat = torch.where(kept.reshape(-1), flat, self.num_experts)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts + 1)[:self.num_experts]
        routed = int(counts.sum())
        arriving = exchange_counts(counts, self.group)  # [source rank, local expert]
        send = counts.view(self.ep, self.num_local).sum(1).tolist()
        recv = arriving.view(self.ep, self.num_local).sum(1).tolist()
        self.tokens_sent, self.tokens_received = send, recv
        x = all_to_all(hidden_states[order[:routed] // k], recv, send, self.group)
        local_ids = torch.arange(self.num_local, device=x.device).repeat(self.ep)
        y = self._local_experts(x, local_ids.repeat_interleave(arriving))
        y = all_to_all(y, send, recv, self.group)
        if routed < order.numel():  # the dropped copies come back as zeros
            y = torch.cat([y, y.new_zeros(order.numel() - routed, y.shape[-1])])
        weighted = y * top_k_weights.reshape(-1)[order].unsqueeze(-1).to(y.dtype)
        unsort = torch.empty_like(order)
        unsort[order] = torch.arange(order.numel(), device=order.device)
        # summing the k copies of a token in slot order is what transformers' own forward does
        return weighted[unsort].view(tokens, k, -1).sum(1).to(hidden_states.dtype)

    def _local_experts(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        weights = {n: p.to_local() if isinstance(p, DTensor) else p
                   for n, p in self.named_parameters(recurse=False)}
        if x.shape[0] == 0:
            # keep x and the weights in the graph: the backward all-to-all and the gradient
            # reduction must run on every rank even when none of its experts were chosen
            touch = sum(w.sum() for w in weights.values()) * 0
            return x * 0 + touch
        inner = self._compute
        try:
            # plain attributes, not parameters: the local views carry the autograd edge back
            # to this module's DTensor parameters
            for name, w in weights.items():
                object.__setattr__(inner, name, w)
            ones = torch.ones(x.shape[0], 1, dtype=x.dtype, device=x.device)
            return inner(x, ids.unsqueeze(1), ones)
        finally:
            for name in weights:
                object.__setattr__(inner, name, None)


def apply_expert_parallel(model: nn.Module, plan: Plan | None, ep_mesh: DeviceMesh
                          ) -> list[ExpertParallelExperts]:
    """Swap every expert module of ``model`` for its expert-parallel version (in place)."""
    paths = find_experts(model)
    if not paths:
        raise PlanError("the plan splits experts over ep but the model has no expert "
                        "modules with stacked 3-D parameters; re-plan with ep=1")
    return split_experts_at(model, paths, ep_mesh, model)


def split_experts_at(holder: nn.Module, paths: list[str], ep_mesh: DeviceMesh,
                     model: nn.Module) -> list[ExpertParallelExperts]:
    """Replace the experts module at each of ``paths`` in ``holder`` (a model, or a pipeline
    stage of ``model``) with its expert-parallel version over ``ep_mesh``; returns them."""
    swapped = []
    for path in paths:
        parent_name, _, child = path.rpartition(".")
        parent = holder.get_submodule(parent_name) if parent_name else holder
        experts = getattr(parent, child)
        module = ExpertParallelExperts(experts, ep_mesh, _num_experts(model, experts))
        setattr(parent, child, module)
        swapped.append(module)
    return swapped


def dense_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The flattened dp x ep mesh: the ranks dense parameters are replicated over and whose
    losses make up the global mean (flattening twice returns the same mesh)."""
    return mesh["dp", "ep"]._flatten("dp_ep")


def replica_group(plan: Plan, mesh: DeviceMesh, dp_group):
    """The ranks whose dense gradients and losses are averaged together: dp x ep under
    expert parallelism, else ``dp_group``."""
    return dense_mesh(mesh).get_group() if plan.mesh["ep"] > 1 else dp_group


def data_rank(mesh: DeviceMesh) -> int:
    """Which of the dp x ep data shards this rank reads (dp-major, as the mesh is laid out)."""
    return mesh["dp"].get_local_rank() * mesh["ep"].size() + mesh["ep"].get_local_rank()


def experts_use_ddp(plan: Plan) -> bool:
    """Whether an expert-parallel plan replicates its dense parameters with DDP (or, in a
    pipeline, an all-reduce after the schedule's step) rather than fully_shard: ZeRO-0/1
    without tensor parallelism or offload (ZeRO-1 then shards the optimizer states:
    :mod:`autopar.parallel.expert_zero`)."""
    return plan.zero_stage <= 1 and not plan.offloads_state and plan.mesh["tp"] == 1


def shard_expert_data_parallel(model: nn.Module, plan: Plan, mesh: DeviceMesh,
                               experts: list[ExpertParallelExperts]) -> bool:
    """The fully_shard half of :func:`apply_expert_data_parallel`, in place (on a meta model
    or pipeline stage, before ``materialize``); returns whether it applied."""
    if experts_use_ddp(plan):
        return False
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    dp, ep = plan.mesh["dp"], plan.mesh["ep"]
    dense = dense_mesh(mesh)
    reshard = plan.zero_stage == 3
    policy = CPUOffloadPolicy(pin_memory=_has_accelerator()) if plan.offloads_state else \
        OffloadPolicy()
    mp = mixed_precision_policy(plan)
    for module in experts:
        fully_shard(module, mesh=mesh["dp"], reshard_after_forward=reshard,
                    offload_policy=policy, mp_policy=mp)
        # each rank's expert gradient already sums the ep ranks' tokens: dividing the dp
        # sum by dp x ep gives the gradient of the global-batch mean loss
        module.set_gradient_divide_factor(float(dp * ep))
        # a sum then one division (gloo has no pre-multiplied sum); not with dp = 1, where
        # torch 2.13's one-rank shortcut already divides and would divide a second time
        module.set_force_sum_reduction_for_comms(dp > 1)
    present = {n for n, _ in model.named_modules()}  # a pipeline stage holds some layers
    for name in (n for n in _layer_names(plan) if n in present):
        fully_shard(model.get_submodule(name), mesh=dense, reshard_after_forward=reshard,
                    offload_policy=policy, mp_policy=mp)
    fully_shard(model, mesh=dense, reshard_after_forward=reshard, offload_policy=policy,
                mp_policy=mp)
    return True


def replicate_expert_data_parallel(model: nn.Module, plan: Plan, mesh: DeviceMesh,
                                   experts: list[ExpertParallelExperts]) -> nn.Module:
    """The DDP half of :func:`apply_expert_data_parallel` (ZeRO-0/1): DDP over dp x ep for the
    dense parameters, the experts ignored. Needs real tensors: after ``materialize``."""
    if not experts_use_ddp(plan):
        return model
    mine = {id(p) for m in experts for p in m.parameters()}
    ignore = [n for n, p in model.named_parameters() if id(p) in mine]
    nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
        model, ignore)
    return nn.parallel.DistributedDataParallel(model, process_group=dense_mesh(mesh).get_group())


def apply_expert_data_parallel(model: nn.Module, plan: Plan, mesh: DeviceMesh,
                               experts: list[ExpertParallelExperts]) -> nn.Module:
    """Data parallelism for an expert-parallel model: DDP over dp x ep for the dense
    parameters (experts left to :func:`sync_expert_grads`), or fully_shard with the dense
    modules over the flattened dp x ep mesh and the experts over dp. The Trainer calls the
    two halves separately, around ``materialize``."""
    if shard_expert_data_parallel(model, plan, mesh, experts):
        return model
    return replicate_expert_data_parallel(model, plan, mesh, experts)


def sync_expert_grads(experts: list[ExpertParallelExperts], plan: Plan,
                      dp_group: dist.ProcessGroup | None) -> None:
    """Expert gradients under DDP (ZeRO-0/1): sum over dp, divide by dp x ep, in one
    all-reduce. fully_shard runs do this in their reduce-scatter instead."""
    from torch.distributed.fsdp import FSDPModule

    if not experts or isinstance(experts[0], FSDPModule):
        return
    params = [p for m in experts for p in m.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:  # no token reached these experts this step
            p.grad = torch.zeros_like(p)
    grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    if dp_group is not None and plan.mesh["dp"] > 1:
        dist.all_reduce(flat, group=dp_group)
    flat /= plan.mesh["dp"] * plan.mesh["ep"]
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()
