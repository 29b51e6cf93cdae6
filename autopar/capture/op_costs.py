"""Per-op kind, FLOPs and bytes for the ops torch.export and fx produce.

Conventions (shared with the ONNX importer so both front doors agree):
- a multiply-add is 2 FLOPs; a bias add or any other elementwise op is 1 FLOP per output element;
- a fused norm is 5 FLOPs per element; softmax 5 per element;
- attention is the two matmuls, 4*b*heads*s_q*s_k*d, over the full (non-causal) score matrix,
  as Megatron-LM and Narayanan et al. (SC21) count it;
- views move no data; everything else reads its tensor inputs and writes its outputs once.
"""

from __future__ import annotations

from math import prod

from autopar.ir.graph import OpKind, TensorMeta

# aten overload packet names (the part after "aten.", before the overload) -> kind
_VIEW = {
    "view", "_unsafe_view", "reshape", "transpose", "permute", "expand", "slice", "select",
    "unsqueeze", "squeeze", "split", "split_with_sizes", "chunk", "unbind", "alias", "t",
    "detach", "lift_fresh_copy", "as_strided", "narrow", "unflatten", "flatten", "getitem",
    "view_as", "expand_as", "movedim", "_reshape_alias", "diagonal", "unfold",
}
_COPY = {"contiguous", "clone", "cat", "stack", "_to_copy", "to", "copy", "copy_", "pad",
         "constant_pad_nd", "repeat", "repeat_interleave", "roll", "flip", "tril", "triu"}
_REDUCTION = {
    "sum", "mean", "amax", "amin", "max", "min", "var", "std", "var_mean", "norm",
    "linalg_vector_norm", "cumsum", "cumprod", "topk", "sort", "argmax", "argmin", "argsort",
    "logsumexp", "prod", "any", "all", "histc", "bincount", "nll_loss", "cross_entropy_loss",
    "nll_loss_forward", "count_nonzero", "cross_entropy",
}
_SOFTMAX = {"softmax", "_softmax", "log_softmax", "_log_softmax", "_safe_softmax"}
_NORM = {"layer_norm", "native_layer_norm", "rms_norm", "_fused_rms_norm", "group_norm",
         "native_group_norm", "batch_norm", "native_batch_norm", "_native_batch_norm_legit",
         "_native_batch_norm_legit_no_training", "instance_norm"}
_ATTENTION = {"scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
              "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
              "_scaled_dot_product_flash_attention_for_cpu", "flex_attention"}
_MATMUL = {"mm", "bmm", "matmul", "addmm", "baddbmm", "addbmm", "einsum", "linear", "_grouped_mm",
           "convolution", "conv1d", "conv2d", "conv3d", "_convolution"}
_CREATE = {"arange", "zeros", "ones", "full", "empty", "new_ones", "new_zeros", "new_full",
           "new_empty", "empty_like", "zeros_like", "ones_like", "full_like", "rand", "randn",
           "scalar_tensor", "randint", "rand_like", "randn_like", "empty_strided"}
_NO_FLOP_ELEMENTWISE = {"embedding", "index", "index_select", "gather", "scatter", "index_put",
                        "index_put_", "masked_fill", "where", "scatter_add", "index_add",
                        "index_copy", "masked_scatter", "take_along_dim"}


def packet_name(target: str) -> str:
    """``aten.linear.default`` -> ``linear``; ``<built-in function getitem>`` -> ``getitem``;
    ``transformers.grouped_mm_fallback.default`` -> ``grouped_mm_fallback``."""
    if target.startswith("<built-in function "):
        return target[len("<built-in function "):-1]
    parts = target.split(".")
    if len(parts) >= 3:
        return parts[-2]
    return parts[-1]


def base_kind(target: str, has_param_operand: bool) -> OpKind:
    """Kind of an op from its target alone (module context refines it later)."""
    name = packet_name(target)
    if name in _VIEW:
        return OpKind.VIEW
    if name in _ATTENTION:
        return OpKind.ATTENTION
    if name in _NORM:
        return OpKind.NORM
    if name == "embedding" or name == "embedding_bag":
        return OpKind.EMBEDDING
    if name in _MATMUL or "grouped_mm" in name:
        if "grouped_mm" in name:
            return OpKind.MOE_EXPERT
        return OpKind.LINEAR if has_param_operand else OpKind.MATMUL
    if name in _REDUCTION or name in _SOFTMAX:
        return OpKind.REDUCTION
    if name in _CREATE or name in _NO_FLOP_ELEMENTWISE:
        return OpKind.OTHER
    if name.startswith("_assert") or name in {"sym_size", "sym_numel", "_local_scalar_dense"}:
        return OpKind.OTHER
    return OpKind.ELEMENTWISE


def matmul_flops(name: str, ins: list[TensorMeta], outs: list[TensorMeta]) -> int:
    """FLOPs of a matmul-like op from its input and output shapes."""
    if not outs:
        return 0
    out = outs[0]
    if name == "linear":
        w = ins[1]
        k = w.shape[-1] if len(w.shape) >= 1 else 1
        flops = 2 * out.numel * k
        if len(ins) > 2:  # bias
            flops += out.numel
        return flops
    if name in ("addmm", "baddbmm", "addbmm"):
        a = ins[1]
        return 2 * out.numel * a.shape[-1] + out.numel
    if name in ("mm", "bmm", "matmul"):
        a = ins[0]
        return 2 * out.numel * (a.shape[-1] if a.shape else 1)
    if "grouped_mm" in name:
        # (tokens, k) @ (experts, k, n) with group offsets: each row meets one expert.
        a = ins[0]
        return 2 * out.numel * (a.shape[-1] if a.shape else 1)
    if name in ("convolution", "_convolution", "conv1d", "conv2d", "conv3d"):
        w = ins[1]
        # weight: (C_out, C_in/groups, *kernel): each output element takes C_in/groups*kernel MACs
        per_out = prod(w.shape[1:]) if len(w.shape) > 1 else 1
        flops = 2 * out.numel * per_out
        if len(ins) > 2:
            flops += out.numel
        return flops
    if name == "einsum":
        # Unknown contraction size from shapes alone: count the larger of the two operands'
        # numel times the output's last dim as a conservative matmul estimate.
        big = max((m.numel for m in ins), default=0)
        return 2 * max(big, out.numel)
    return 2 * out.numel


def attention_flops(ins: list[TensorMeta]) -> int:
    """4*b*h*s_q*s_k*d for q (b, h, s_q, d), k (b, h_kv, s_k, d), v (b, h_kv, s_k, d_v)."""
    if len(ins) < 3:
        return 0
    q, k, v = ins[0], ins[1], ins[2]
    if len(q.shape) < 2 or len(k.shape) < 2:
        return 0
    s_q, d = q.shape[-2], q.shape[-1]
    s_k, d_v = k.shape[-2], v.shape[-1]
    batch_heads = prod(q.shape[:-2])
    return 2 * batch_heads * s_q * s_k * d + 2 * batch_heads * s_q * s_k * d_v


def op_flops(target: str, kind: OpKind, ins: list[TensorMeta], outs: list[TensorMeta]) -> int:
    """Forward FLOPs of one op under the conventions in this module's docstring."""
    name = packet_name(target)
    out_numel = sum(m.numel for m in outs)
    if kind is OpKind.VIEW:
        return 0
    if kind is OpKind.ATTENTION and name in _ATTENTION:
        return attention_flops(ins)
    if name in _MATMUL or "grouped_mm" in name:
        return matmul_flops(name, ins, outs)
    if name in _NORM:
        return 5 * (ins[0].numel if ins else out_numel)
    if name in _SOFTMAX:
        return 5 * out_numel
    if name in _REDUCTION:
        return ins[0].numel if ins else out_numel
    if name in _COPY or name in _CREATE or name in _NO_FLOP_ELEMENTWISE:
        return 0
    if name.startswith("_assert"):
        return 0
    return out_numel


def op_bytes(kind: OpKind, ins: list[TensorMeta], outs: list[TensorMeta], target: str = "") -> tuple[int, int]:
    """(bytes read, bytes written); an embedding lookup reads only the rows it gathers."""
    if kind is OpKind.VIEW:
        return 0, 0
    written = sum(m.nbytes for m in outs)
    if packet_name(target) in ("embedding", "embedding_bag") and len(ins) >= 2:
        return ins[1].nbytes + written, written
    return sum(m.nbytes for m in ins), written
