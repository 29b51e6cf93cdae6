"""The recompute modes, and the op-level policy of mode ``op``: one table that the cost model
prices (which graph ops' outputs a block keeps) and the runtime runs (the
``create_selective_checkpoint_contexts`` policy in :mod:`autopar.parallel.policies`).

Modes, from most memory to least:

- ``none``: autograd keeps what every op saves;
- ``selective``: Megatron-LM's selective recompute, the attention core re-run (Korthikanti et
  al. 2022, "Reducing Activation Recomputation in Large Transformer Models", Sec. 4.2);
- ``op``: torchtitan's op-level selective activation checkpointing, its default for Llama
  (``SelectiveAC`` in pytorch/torchtitan torchtitan/distributed/activation_checkpoint.py; in
  2024, when its published A100/H100 tables were measured, the same policy was the
  ``_save_list`` of torchtitan/parallelisms/parallelize_llama.py, e.g. commit fa8cdd48e). Each
  block is checkpointed; the outputs of the compute-intensive ops are kept (the ops of
  ``torch._functorch.partitioners.get_default_op_list().compute_intensive_ops``: mm, addmm,
  bmm, _scaled_mm, the fused attention kernels, convolution; plus aten.linear, full max and
  the reduce-scatter and all-to-all collectives; torchtitan's topk is re-run here, see
  ``OP_POLICY_SAVED``), except every second ``mm`` / ``linear`` of the block, counted in
  forward order, which is re-run with everything else (norms, activations, rotary,
  elementwise). For a Llama block that keeps the block input, the q and v projections, the
  fused attention output (and its log-sum-exp), the gate projection and the down projection;
  it re-runs the k, output and up projections;
- ``full``: only the block's inputs are kept, the whole block re-runs.

torchtitan's policy sees ops at dispatch level: an ``nn.Linear`` without bias reaches it as
``aten.mm`` (counted), with a bias as ``aten.addmm`` (always kept); a ``matmul`` of a batch by
a weight matrix folds into one ``mm``, a batch by a batch becomes ``bmm`` (always kept).
:func:`dispatched_op` maps a captured op to that name.
"""

from __future__ import annotations

from autopar.capture.op_costs import packet_name
from autopar.ir.blocks import LAYERLESS_BLOCKS
from autopar.ir.graph import Block, Graph, OpKind, OpNode

RECOMPUTE_MODES = ("none", "selective", "op", "full")
# LAYERLESS_BLOCKS (re-exported): the blocks that are not a repeated layer (the embedding, the
# head with its loss, a model with no layers): mode ``op`` leaves them unwrapped, as
# torchtitan does

# dispatch-level aten ops (packet names) whose outputs mode "op" keeps: torchtitan's
# _get_default_save_ops (compute_intensive_ops, its explicit SDPA / linear / topk list, the
# collectives). _scaled_dot_product_flash_attention_for_cpu is the CPU build of the flash kernel
# that CUDA runs as _scaled_dot_product_flash_attention: kept so that a CPU run keeps what a
# GPU run keeps. torchtitan also keeps topk (its MoE routing, for determinism); autopar re-runs
# it: a Hugging Face router normalises its top-k weights in place (Mixtral's /=), and a kept
# output changed in place is replayed with wrong router gradients (46% off on a tiny Mixtral).
# The bytes are a few per token, the seconds a memory-bound kernel's
OP_POLICY_SAVED = frozenset({
    "mm", "addmm", "bmm", "_scaled_mm", "linear", "convolution",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_attention_math",
    "_scaled_dot_product_fused_attention_overrideable", "_flash_attention_forward",
    "_efficient_attention_forward", "_scaled_dot_product_flash_attention_for_cpu",
    "reduce_scatter_tensor", "all_to_all_single",
})
# kept only in this overload: the full reduction (an fp8 scale's absolute maximum)
OP_POLICY_SAVED_OVERLOADS = frozenset({"max.default"})
# of the kept ops, these alternate: the 2nd, 4th, ... of a block's forward are re-run
OP_POLICY_ALTERNATING = frozenset({"mm", "linear"})

# captured fused-attention ops: every CUDA build of them is on the kept list
_FUSED_ATTENTION = {"scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
                    "_scaled_dot_product_efficient_attention",
                    "_scaled_dot_product_cudnn_attention",
                    "_scaled_dot_product_flash_attention_for_cpu", "flash_attn_func",
                    "_flash_attention_forward"}


def dispatched_op(op: OpNode) -> str:
    """The dispatch-level aten op (packet name) that the policy of mode ``op`` sees for a
    captured op: ``linear`` is ``addmm`` with a bias and ``mm`` without; ``matmul`` / ``einsum``
    are ``mm`` against a weight matrix (2-D right operand) and ``bmm`` otherwise; a captured
    fused attention op is a kept attention kernel; anything else keeps its name."""
    name = packet_name(op.target)
    if name == "linear":
        has_bias = len(op.input_meta) >= 3 and op.input_meta[2] is not None
        return "addmm" if has_bias else "mm"
    if name in ("matmul", "einsum"):
        right = op.input_meta[1].shape if len(op.input_meta) > 1 else ()
        return "mm" if len(right) == 2 else "bmm"
    if name in _FUSED_ATTENTION or op.kind is OpKind.ATTENTION and "attention" in name:
        return "_scaled_dot_product_flash_attention"
    if name == "max" and str(op.target).endswith(".default") and len(op.inputs) == 1:
        return "max.default"
    return name


def op_policy_keeps(name: str, alternating_seen: int) -> bool:
    """Whether the op-level policy keeps the output of dispatched op ``name`` (a packet name,
    or ``max.default``), given that it is the ``alternating_seen``-th mm/linear of the block's
    forward (1-based; ignored for other ops)."""
    if name in OP_POLICY_ALTERNATING:
        return alternating_seen % 2 == 1
    return name in OP_POLICY_SAVED or name in OP_POLICY_SAVED_OVERLOADS


def op_policy_saved(graph: Graph, block: Block) -> set[str]:
    """The graph ops of ``block`` whose outputs mode ``op`` keeps from the forward to the
    backward (everything else in the block is re-run by the backward)."""
    kept: set[str] = set()
    alternating = 0
    for name in block.nodes:
        op = graph.op(name)
        if op.kind is OpKind.VIEW:
            continue
        dispatched = dispatched_op(op)
        if dispatched in OP_POLICY_ALTERNATING:
            alternating += 1
        if op_policy_keeps(dispatched, alternating):
            kept.add(name)
    return kept


__all__ = ["LAYERLESS_BLOCKS", "OP_POLICY_ALTERNATING", "OP_POLICY_SAVED", "OP_POLICY_SAVED_OVERLOADS",
           "RECOMPUTE_MODES", "dispatched_op", "op_policy_keeps", "op_policy_saved"]
