"""The dtype each value of a captured graph holds when the model trains with fp32 parameters
under autocast, as autopar's runtime trains without fully_shard (one device, DDP, tensor
parallelism on plain replicas).

A captured graph carries the dtypes of one uniform precision (the config's: fp32 for the tiny
models, bf16 for the published ones). Under autocast the run is mixed: only the ops on
autocast's lower-precision list (linear, matmul, fused attention, and the experts' grouped
GEMM by autopar's own rule: :mod:`autopar.train.autocast_ops`) compute in bf16; the embedding
reads an fp32 table, so the residual stream, the norms and every op that meets an fp32 value
or parameter stay in fp32 (PyTorch's type promotion), and the ops autocast runs in fp32
(softmax, log-softmax, sums, exponentials, losses) produce fp32. A linear that reads an fp32
activation casts it to bf16 for itself (autocast caches casts of parameters only) and keeps that
copy for its backward: q, k and v projections of one norm output keep three copies. Measured
on CPU against what autograd saves (``tests/cost/test_autocast_activations.py``).

Rules (PyTorch's "Autocast Op Reference": CUDA ops that autocast to float16 / to float32):
explicit casts of the capture keep their meaning: an upcast to fp32 is fp32 at run time too, a
cast back down (``x.to(input_dtype)``) returns to the dtype the module's input had at run time.
"""

from __future__ import annotations

import weakref

from autopar.capture.op_costs import packet_name
from autopar.cost.compute import is_fused_attention
from autopar.ir.graph import Graph, OpKind, OpNode

FLOAT_DTYPES = ("float32", "float16", "bfloat16", "float64")
COMPUTE_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}
# ops autocast runs in fp32 whatever their inputs (CUDA's "ops that can autocast to float32")
FP32_OPS = frozenset({
    "softmax", "_softmax", "log_softmax", "_log_softmax", "cumsum", "cumprod", "sum", "prod",
    "exp", "expm1", "log", "log1p", "log2", "log10", "rsqrt", "reciprocal", "pow", "softplus",
    "layer_norm", "native_layer_norm", "group_norm", "norm", "logsumexp", "nll_loss",
    "nll_loss_forward", "cross_entropy", "cross_entropy_loss", "mse_loss", "kl_div",
    "binary_cross_entropy_with_logits", "cosine_similarity",
})
_CASTS = ("to", "_to_copy", "type_as")
_MEMO: weakref.WeakKeyDictionary[Graph, dict] = weakref.WeakKeyDictionary()


def is_float(dtype: str) -> bool:
    return dtype in FLOAT_DTYPES


def captured_dtype(graph: Graph, name: str) -> str:
    """The dtype the capture gave value ``name`` (an op's output or a graph input); "" when
    the graph holds no such value."""
    if graph.has_op(name):
        meta = graph.op(name).output_meta
        return meta[0].dtype if meta else ""
    return next((i.meta.dtype for i in graph.inputs if i.name == name), "")


def lower_precision(op: OpNode) -> bool:
    """Whether autocast runs ``op`` in the compute dtype (and casts its inputs to it)."""
    if op.kind in (OpKind.LINEAR, OpKind.MATMUL):
        return True
    if op.kind is OpKind.ATTENTION:
        return is_fused_attention(op)
    return op.kind is OpKind.MOE_EXPERT and "mm" in packet_name(op.target)


def runtime_dtypes(graph: Graph, compute: str) -> dict[str, str]:
    """Each value's dtype (torch's name, e.g. ``"float32"``) under autocast to ``compute``
    ("bf16" or "fp16") with fp32 parameters; integer and boolean values keep theirs."""
    memo = _MEMO.setdefault(graph, {})
    if compute not in memo:
        memo[compute] = _propagate(graph, COMPUTE_DTYPES[compute])
    return memo[compute]


def _propagate(graph: Graph, low: str) -> dict[str, str]:
    out = {i.name: ("float32" if is_float(i.meta.dtype) else i.meta.dtype) for i in graph.inputs}
    module_input: dict[str, str] = {}  # the run-time dtype of the first float value a module reads
    for op in graph.ops:
        captured = op.output_meta[0].dtype if op.output_meta else "int64"
        ins = [out[s] for s in op.inputs if is_float(out.get(s, ""))]
        # trained parameters are fp32 masters; a fine-tune's frozen base is held in the
        # parameter dtype (autopar.peft.hold_frozen)
        held = ["float32" if graph.params.get(p) is None or graph.params[p].trainable else low
                for p in op.params]
        if op.module_path and ins:
            module_input.setdefault(op.module_path, ins[0])
        if not is_float(captured):
            out[op.name] = captured
            continue
        name = packet_name(op.target)
        if name in _CASTS and op.input_meta and op.input_meta[0].dtype != captured:
            if captured == "float32":  # an explicit upcast
                out[op.name] = "float32"
            else:  # back down to what the module was given
                out[op.name] = module_input.get(op.module_path, ins[0] if ins else low)
        elif op.kind is OpKind.VIEW or name in _CASTS:
            out[op.name] = ins[0] if ins else (held[0] if held else "float32")
        elif lower_precision(op):
            out[op.name] = low
        elif name in FP32_OPS or "float32" in ins or "float32" in held:
            out[op.name] = "float32"
        else:
            out[op.name] = ins[0] if ins else (held[0] if held else low)
    return out


__all__ = ["COMPUTE_DTYPES", "captured_dtype", "is_float", "lower_precision", "runtime_dtypes"]
