"""Apply a Plan to a module with PyTorch's own pieces: DTensor tensor and sequence parallelism
(in tensor_parallel.py), checkpoint wrappers for recompute, DDP / ZeroRedundancyOptimizer /
fully_shard for data parallelism."""

from __future__ import annotations

import os
from functools import partial

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from autopar.cost.recompute_policy import OP_POLICY_ALTERNATING, op_policy_keeps
from autopar.plan import Plan
from autopar.runtime.tensor_parallel import apply_tensor_parallel, layer_names, tied_modules

__all__ = ["apply_data_parallel", "apply_recompute", "apply_tensor_parallel",
           "replicate_data_parallel", "shard_data_parallel"]


# older private names, still imported by sibling modules
_layer_names = layer_names
_tied_modules = tied_modules


def apply_recompute(model: nn.Module, plan: Plan, skip_missing: bool = False) -> None:
    """Wrap each block's module as the plan says. ``full`` checkpoints the whole layer;
    ``selective`` checkpoints it too, but with a policy that keeps every op's output except
    the attention core's (the cost model's meaning: from the score matmul to the value matmul,
    or the fused SDPA op), so only those are recomputed, whatever the attention child is
    called; ``op`` checkpoints it with torchtitan's op-level policy (:func:`op_level_policy`),
    the one the cost model prices. ``skip_missing`` for a pipeline stage that holds some layers."""
    seq = next(iter(plan.model["inputs"].values()))[-1]
    for block, mode in zip(plan.model["blocks"], plan.recompute, strict=True):
        name = block["name"]
        if mode == "none" or name in ("head", "tail", "root"):
            continue
        if skip_missing:
            try:
                model.get_submodule(name)
            except AttributeError:
                continue
        recompute_block(model, name, mode, seq)


def recompute_block(model: nn.Module, name: str, mode: str, seq: int) -> None:
    """Wrap the module at ``name`` for ``mode`` recompute ("full", "selective" or "op", see
    :func:`apply_recompute`); ``seq`` is the sequence length (selective recompute recognises
    the seq x seq score tensors)."""
    if mode == "none":
        return
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    kwargs = {}
    if mode == "selective":
        # a kept output may be changed in place later in the forward (Mixtral's router
        # normalises its top-k weights with /=). The recompute then replays the kept
        # outputs, in-place ops included, without running them again; only the attention
        # core re-runs, and nothing they read is written in place
        kwargs["context_fn"] = partial(create_selective_checkpoint_contexts,
                                       attention_core_policy(seq),
                                       allow_cache_entry_mutation=True)
    elif mode == "op":
        kwargs["context_fn"] = op_level_contexts
    setattr(parent, child, checkpoint_wrapper(getattr(parent, child), **kwargs))


_SDPA = {"_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
         "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_cudnn_attention",
         "_scaled_dot_product_attention_math", "scaled_dot_product_attention"}


def attention_core_policy(seq: int):
    """Selective-checkpoint policy: recompute the fused attention op and every op whose output
    is a seq x seq score tensor (score matmul, scale, mask, softmax, dropout); save the rest."""

    def scores(t: object) -> bool:
        return isinstance(t, torch.Tensor) and t.dim() >= 3 and t.shape[-2:] == (seq, seq)

    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        name = getattr(op, "__name__", "").split(".")[0]
        if name in _SDPA or any(scores(a) for a in args):
            return CheckpointPolicy.PREFER_RECOMPUTE
        if name in ("bmm", "baddbmm") and args[-2].shape[-2] == seq and \
                args[-1].shape[-1] == seq:  # the score matmul q @ k^T
            return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE

    return policy


def op_level_policy():
    """A fresh selective-checkpoint policy of recompute mode ``op`` (torchtitan's op-level
    policy, :mod:`autopar.cost.recompute_policy`): keep the outputs of the kept ops, except
    every second mm / linear of the block's forward; recompute everything else. The count is
    kept apart for the forward and for the backward's recompute, so both see the same
    decisions."""
    counts = {False: 0, True: 0}  # is_recompute -> mm / linear seen

    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        name = getattr(op, "__name__", "")
        packet = name.split(".")[0]
        if packet in OP_POLICY_ALTERNATING:
            counts[ctx.is_recompute] += 1
        keep = op_policy_keeps(name if name == "max.default" else packet,
                               counts[ctx.is_recompute])
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def op_level_contexts():
    """The checkpoint ``context_fn`` of recompute mode ``op``: one fresh policy per forward of
    the block (the mm count starts again at each block, as torchtitan's does). A kept output
    changed in place later in the forward would be replayed with wrong gradients: PyTorch's
    check that refuses it stays on (the policy re-runs top-k for that reason)."""
    return create_selective_checkpoint_contexts(op_level_policy())


def data_parallel_wrapper(plan: Plan) -> str:
    """"fully_shard", "ddp" or "none": which wrapper the plan's data parallelism uses. DDP for
    ZeRO-0/1 (1 adds a sharded optimizer), fully_shard for ZeRO-2 (parameters kept gathered
    from the forward to the end of the backward) and ZeRO-3, and for offload (with one device
    too). The generated program states it; the runtime applies it."""
    if {"optimizer", "params"} & set(plan.offload):
        return "fully_shard"
    if plan.mesh["dp"] == 1:
        return "none"
    return "ddp" if plan.zero_stage <= 1 else "fully_shard"


def data_parallel_kind(plan: Plan, dp_mesh: DeviceMesh | None) -> str:
    """:func:`data_parallel_wrapper` on this rank: "none" without a data-parallel mesh."""
    return "none" if dp_mesh is None else data_parallel_wrapper(plan)


def shard_data_parallel(module: nn.Module, plan: Plan, dp_mesh: DeviceMesh | None) -> bool:
    """The fully_shard half of :func:`apply_data_parallel`: ``module`` (the model, or a
    pipeline stage) gets fully_shard on the plan's layers it holds, then on itself, as the
    plan's ZeRO stage (2/3) and offload say; returns whether it applied. Works on a meta
    module, before ``materialize``."""
    if data_parallel_kind(plan, dp_mesh) != "fully_shard":
        return False
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    reshard = plan.zero_stage == 3
    # FSDP2 offloads parameters, gradients and the optimizer step together; pinned memory
    # needs an accelerator, so it is pinned only where one exists
    offload = {"optimizer", "params"} & set(plan.offload)
    policy = CPUOffloadPolicy(pin_memory=_has_accelerator()) if offload else OffloadPolicy()
    if offload:
        use_host_cores()
    mp = mixed_precision_policy(plan)
    present = dict(module.named_modules())
    for name in _layer_names(plan):
        if name in present:
            fully_shard(present[name], mesh=dp_mesh, reshard_after_forward=reshard,
                        offload_policy=policy, mp_policy=mp)
    fully_shard(module, mesh=dp_mesh, reshard_after_forward=reshard, offload_policy=policy,
                mp_policy=mp)
    return True


def replicate_data_parallel(model: nn.Module, plan: Plan, dp_mesh: DeviceMesh | None
                            ) -> tuple[nn.Module, bool]:
    """The DDP half of :func:`apply_data_parallel` (ZeRO 0/1). DDP broadcasts and buckets
    real tensors, so it runs after ``materialize``. Returns (model,
    use_zero_redundancy_optimizer); the model unchanged when the plan needs no DDP."""
    if data_parallel_kind(plan, dp_mesh) != "ddp":
        return model, False
    ddp = nn.parallel.DistributedDataParallel(model, process_group=dp_mesh.get_group())
    return ddp, plan.zero_stage == 1


def apply_data_parallel(model: nn.Module, plan: Plan, dp_mesh: DeviceMesh | None
                        ) -> tuple[nn.Module, bool]:
    """DDP for ZeRO 0/1 (with a sharded optimizer for 1) without tensor parallelism, else
    fully_shard: ZeRO-2 keeps parameters gathered after the forward, ZeRO-3 reshards them.
    Optimizer or parameter offload uses fully_shard's CPU offload policy (also with dp = 1).
    The Trainer calls the two halves separately, around ``materialize``.

    Returns (model, use_zero_redundancy_optimizer).
    """
    if shard_data_parallel(model, plan, dp_mesh):
        return model, False
    return replicate_data_parallel(model, plan, dp_mesh)


_TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def torch_dtype(name: str) -> torch.dtype:
    """torch's dtype for a plan's short dtype name (fp32, bf16, fp16)."""
    return getattr(torch, _TORCH_DTYPES[name])


def plan_precision(plan: Plan):
    """The plan's Precision (fp32 when the plan records none)."""
    from autopar.cost.precision import FP32, Precision

    return Precision.from_dict(plan.precision) if plan.precision else FP32


def mixed_precision_policy(plan: Plan):
    """FSDP2's MixedPrecisionPolicy for the plan: parameters gathered in its param dtype,
    gradients reduced in its reduce dtype; the sharded fp32 parameters are the master copy."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    p = plan_precision(plan)
    if p.param == "fp32" and p.reduce == "fp32":
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=torch_dtype(p.param),
                                reduce_dtype=torch_dtype(p.reduce))


def use_host_cores() -> int:
    """Give this process its share of the host's cores for the optimizer step that CPU
    offload runs there, as the cost model prices it (the node's devices share the host):
    torchrun starts every rank with one thread (OMP_NUM_THREADS=1). Never fewer threads than
    the process has; returns the count."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    share = max(1, (os.cpu_count() or 1) // max(local, 1))
    if share > torch.get_num_threads():
        torch.set_num_threads(share)
    return torch.get_num_threads()


def _has_accelerator() -> bool:
    import torch

    return torch.cuda.is_available()
