"""The pieces the generated training program (autopar.codegen.program) calls or states, shared
with the runtime: checkpoint wrappers and their policies for recompute, which data-parallel
wrapper a plan uses (DDP / fully_shard), its precision policies, and the host cores an
offloading rank uses. Applying a plan is the program's job: ``autopar run`` and
``autopar.parallelize`` both run it."""

from __future__ import annotations

import os
from functools import partial

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from autopar.cost.precision import TORCH_DTYPE_NAMES
from autopar.cost.recompute_policy import OP_POLICY_ALTERNATING, op_policy_keeps
from autopar.parallel.tensor_parallel import apply_tensor_parallel, layer_names
from autopar.plan import Plan

__all__ = ["apply_tensor_parallel", "recompute_block"]


# an older private name, still imported by sibling modules
_layer_names = layer_names


def recompute_block(model: nn.Module, name: str, mode: str, seq: int) -> None:
    """Wrap the module at ``name`` (a layer of the plan) for ``mode`` recompute. ``full``
    checkpoints the whole layer; ``selective`` checkpoints it too, but with a policy that keeps
    every op's output except the attention core's (the cost model's meaning: from the score
    matmul to the value matmul, or the fused SDPA op), so only those are recomputed, whatever
    the attention child is called; ``op`` checkpoints it with torchtitan's op-level policy
    (:func:`op_level_policy`), the one the cost model prices. ``seq`` is the sequence length
    (selective recompute recognises the seq x seq score tensors)."""
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
    too). The generated program states it; the runtime applies it: :attr:`Plan.
    data_parallel_wrapper`."""
    return plan.data_parallel_wrapper


def data_parallel_kind(plan: Plan, dp_mesh: DeviceMesh | None) -> str:
    """:func:`data_parallel_wrapper` on this rank: "none" without a data-parallel mesh."""
    return "none" if dp_mesh is None else data_parallel_wrapper(plan)


def torch_dtype(name: str) -> torch.dtype:
    """torch's dtype for a plan's short dtype name (fp32, bf16, fp16)."""
    return getattr(torch, TORCH_DTYPE_NAMES[name])


def plan_precision(plan: Plan):
    """The plan's Precision (fp32 when the plan records none): :attr:`Plan.
    training_precision`."""
    return plan.training_precision


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
