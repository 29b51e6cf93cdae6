"""Import an ONNX file into autopar's IR: the ``.onnx`` front door of :func:`autopar.capture`.

Each ONNX op is costed as the aten op it stands for, through :mod:`autopar.capture.op_costs`, so
a model costs the same through either front door. Module paths come from the metadata that
``torch.onnx.export(..., dynamo=True)`` writes on every node; files from other exporters fall
back to scoped node names (``/layers.0/attn/MatMul``), the parameters an op reads, or the ops
around it.
"""

from __future__ import annotations

import re
from math import prod
from pathlib import Path
from typing import NamedTuple

import numpy as np
import onnx
import onnx.inliner
from onnx import TensorProto, helper, numpy_helper

from autopar.capture import op_costs
from autopar.capture.fx_to_ir import moe_modules, refine_kind
from autopar.capture.torch_capture import first_line
from autopar.errors import CaptureError
from autopar.ir.graph import Graph, GraphInput, OpKind, OpNode, ParamInfo, TensorMeta


def _dtype(elem_type: int) -> str:
    """torch's spelling of an ONNX element type; numpy (with ml_dtypes) spells them alike."""
    try:
        return str(helper.tensor_dtype_to_np_dtype(elem_type))
    except (KeyError, ValueError, TypeError):
        return "float32"


_FLOATS = {"float32", "float16", "bfloat16", "float64", "float8_e4m3fn", "float8_e5m2"}

# ONNX op -> the aten op with the same kind and cost; an unlisted op is elementwise (1 FLOP/elem).
# ONNX Max/Min/Mean/Sum are elementwise over their inputs, unlike aten's reductions of those names.
_ATEN = {
    "Reshape": "reshape", "Transpose": "permute", "Unsqueeze": "unsqueeze", "Squeeze": "squeeze",
    "Slice": "slice", "Split": "split", "Flatten": "flatten", "Identity": "alias",
    "Expand": "expand", "Shape": "alias", "Size": "alias", "Dropout": "alias",
    "Cast": "_to_copy", "CastLike": "_to_copy", "Concat": "cat", "Tile": "repeat", "Pad": "pad",
    "Trilu": "tril", "ConstantOfShape": "full", "Range": "arange", "Where": "where",
    "GatherElements": "gather", "GatherND": "index", "ScatterND": "scatter",
    "ScatterElements": "scatter", "MatMul": "matmul", "Gemm": "linear", "Conv": "convolution",
    "ConvTranspose": "convolution",  # FLOPs approximate: weight dims are (C_in, C_out/g, k...)
    "Einsum": "einsum", "LayerNormalization": "layer_norm",
    "SimplifiedLayerNormalization": "rms_norm", "RMSNormalization": "rms_norm",
    "SkipLayerNormalization": "layer_norm", "SkipSimplifiedLayerNormalization": "rms_norm",
    "BatchNormalization": "batch_norm", "GroupNormalization": "group_norm",
    "InstanceNormalization": "instance_norm", "Softmax": "softmax", "LogSoftmax": "log_softmax",
    "ReduceMean": "mean", "ReduceSum": "sum", "ReduceMax": "amax", "ReduceMin": "amin",
    "ReduceProd": "prod", "ReduceL2": "norm", "ReduceSumSquare": "sum",
    "ReduceLogSumExp": "logsumexp", "ArgMax": "argmax", "ArgMin": "argmin", "TopK": "topk",
    "CumSum": "cumsum", "Attention": "scaled_dot_product_attention",
    "MultiHeadAttention": "scaled_dot_product_attention",
    "GroupQueryAttention": "scaled_dot_product_attention",
}
# A parameter seen through these is still that parameter: MatMul(x, Transpose(W)) reads W.
_PASS_THROUGH = {"Transpose", "Reshape", "Cast", "CastLike", "Identity", "Unsqueeze", "Squeeze",
                 "Flatten"}
_WEIGHT_OPS = {"MatMul", "Gemm", "Conv", "ConvTranspose", "Gather", "Einsum", "Attention"}
_REEXPORT = "re-export it with torch.onnx.export(model, args, path, dynamo=True)"


class _Rec(NamedTuple):
    name: str  # unique op name
    node: onnx.NodeProto
    raws: list[str]  # initializers the op reads, directly or through _PASS_THROUGH ops
    bufs: list[str]
    scope: tuple[str, str, str] | None  # (module path, module class, aten op lowered from)


def _load(path: Path) -> onnx.ModelProto:
    if not path.is_file():
        raise CaptureError(f"cannot read {path}: no such file; check the path, or export the "
                           f"model with torch.onnx.export(model, args, '{path.name}', dynamo=True)")
    try:
        # Weights stored as external data are not read: only their shapes matter here.
        model = onnx.load(str(path), load_external_data=False)
    except Exception as exc:
        raise CaptureError(f"cannot read {path}: not an ONNX protobuf ({first_line(exc)}); "
                           f"{_REEXPORT}") from None
    if not model.graph.node:  # protobuf decodes many non-ONNX files into an empty message
        raise CaptureError(f"cannot read {path}: not an ONNX model (no graph nodes); {_REEXPORT}")
    try:
        if model.functions:  # exporters may wrap modules in local functions; costs need the ops
            model = onnx.inliner.inline_local_functions(model)
        return onnx.shape_inference.infer_shapes(model, check_type=False, strict_mode=False,
                                                 data_prop=True)
    except Exception as exc:
        raise CaptureError(f"cannot import {path}: ONNX shape inference failed "
                           f"({first_line(exc)}); {_REEXPORT} and static input shapes") from None


def _meta(vtype: onnx.TypeProto) -> TensorMeta | str | None:
    """The TensorMeta of a typed value, the name of a symbolic dimension, or None if unknown."""
    if not vtype.HasField("tensor_type") or not vtype.tensor_type.HasField("shape"):
        return None
    dims: list[int] = []
    for d in vtype.tensor_type.shape.dim:
        if d.HasField("dim_param"):
            return d.dim_param
        if not d.HasField("dim_value"):
            return None
        dims.append(d.dim_value)
    return TensorMeta(tuple(dims), _dtype(vtype.tensor_type.elem_type))


def _holds_mask(t: TensorProto, base_dir: str) -> bool:
    """Whether a constant is an additive attention mask: those are baked in as -inf or
    dtype-min fills, which no trained weight holds."""
    try:
        arr = numpy_helper.to_array(t, base_dir=base_dir).astype(np.float32)
    except Exception:
        return False  # external data missing: shapes are all we need, so keep it a parameter
    return not (np.isfinite(arr).all() and arr.min() > -1e4)


def _scope(node: onnx.NodeProto) -> tuple[str, str, str] | None:
    """(module path, module class, aten op the node was lowered from) from exporter metadata,
    or from a scoped node name."""
    # ": pkg.GPT/layers.0: pkg.Block/layers.0.ln1: nn.LayerNorm/layer_norm: aten.layer_norm.default"
    namespace = next((p.value for p in node.metadata_props if p.key == "namespace"), "")
    frames = [f.split(": ", 1) for f in namespace.split("/")] if namespace else []
    if len(frames) >= 2:
        path, cls = (frames[-2] + [""])[:2]
        return path.strip(), cls.rsplit(".", 1)[-1], op_costs.packet_name(frames[-1][-1])
    if node.name.startswith("/"):  # TorchScript exporter: "/layers.0/attn/qkv/MatMul"
        return ".".join(node.name.split("/")[1:-1]), "", ""
    return None


def _common_prefix(paths: list[str]) -> str:
    out: list[str] = []
    for parts in zip(*(p.split(".") if p else [] for p in paths), strict=False):
        if len(set(parts)) > 1:
            break
        out.append(parts[0])
    return ".".join(out)


def _us(name: str) -> str:
    return re.sub(r"\W", "_", name)


def _param_names(raws: list[str], node: onnx.NodeProto, path: str, claimed: set[str]) -> list[str]:
    """FQNs of the parameters an op reads. The exporter folds ``W.t()`` into anonymous
    initializers (``val_7``) and merges initializers with equal values (the ones and zeros of
    fresh LayerNorms), so the parameters the torch node named (``%p_layers_1_ln2_weight``) are
    the better record; they are paired with the initializers that lack a name of their own."""
    fx = next((p.value for p in node.metadata_props if p.key == "pkg.torch.onnx.fx_node"), "")
    tokens = list(dict.fromkeys(re.findall(r"%p_(\w+)", fx)))
    unnamed = [r for r in raws if _us(r) not in tokens]
    open_tokens = [t for t in tokens if t not in claimed]
    prefix = _us(path) + "_"
    if len(unnamed) == 1 < len(open_tokens):  # the optimizer also drops all-zero biases
        open_tokens = [t for t in open_tokens if t.endswith("_weight")]
    if (not path or not unnamed or len(unnamed) != len(open_tokens)
            or not all(t.startswith(prefix) for t in open_tokens)):
        return raws
    rename = {r: f"{path}.{t[len(prefix):]}" for r, t in zip(unnamed, open_tokens, strict=True)}
    return [rename.get(r, r) for r in raws]


def _attention_flops(ins: list[TensorMeta], outs: list[TensorMeta], fused_qkv: bool) -> int:
    if len(ins) < 2 or not outs or len(ins[0].shape) not in (3, 4):
        return 0
    if fused_qkv:  # com.microsoft Attention: x (b, s, hidden) @ packed weight, then attention
        b, s, _ = ins[0].shape
        return 2 * ins[0].numel * ins[1].shape[-1] + 4 * b * s * s * outs[0].shape[-1]
    if len(ins) < 3:
        return 0
    if len(ins[0].shape) == 4:
        return op_costs.attention_flops(ins[:3])
    b, s_q, qk = ins[0].shape  # heads folded into the hidden dim: (b, s, heads * d)
    return 2 * b * s_q * ins[1].shape[1] * (qk + outs[0].shape[-1])


def _cost(node: onnx.NodeProto, ins: list[TensorMeta], outs: list[TensorMeta], reads_param: bool,
          embeds: bool, scope: tuple[str, str, str], moe: set[str]) -> tuple[OpKind, str, int]:
    """(kind, aten-style target, FLOPs) of one node under op_costs' conventions."""
    op = node.op_type
    aten = _ATEN.get(op, "onnx_" + op)
    if op == "Gather":
        aten = "embedding" if embeds else "select" if ins[1].shape == () else "index_select"
    target = f"aten.{aten}.default"
    kind = op_costs.base_kind(target, has_param_operand=reads_param)
    if op in ("Cast", "CastLike") and ins[0].dtype == outs[0].dtype:
        kind = OpKind.VIEW  # a cast to the same dtype is a no-op
    kind = refine_kind(kind, aten, scope[0], scope[1], moe)
    if scope[2] in op_costs._ATTENTION and kind is not OpKind.VIEW:
        # SDPA lowered to matmuls, scale, mask and softmax is still one attention, and costs
        # only its two matmuls, as torch's fused SDPA does.
        flops = op_costs.op_flops(target, kind, ins, outs) if op == "MatMul" else 0
        return OpKind.ATTENTION, target, flops
    if kind is OpKind.VIEW:
        return kind, target, 0
    if op == "Gemm":
        k = ins[0].shape[0 if any(a.name == "transA" and a.i for a in node.attribute) else -1]
        return kind, target, 2 * outs[0].numel * k + (outs[0].numel if len(ins) > 2 else 0)
    if aten == "scaled_dot_product_attention":
        fused = node.domain == "com.microsoft" and op == "Attention"
        return kind, target, _attention_flops(ins, outs, fused)
    return kind, target, op_costs.op_flops(target, kind, ins, outs)


def _place_unscoped(records: list[_Rec]) -> None:
    """Give ops the exporter added itself (no scope) the common module of their neighbours."""
    scope_of = {out: rec.scope for rec in records for out in rec.node.output}
    users: dict[str, list[_Rec]] = {}
    for rec in records:
        for v in rec.node.input:
            users.setdefault(v, []).append(rec)
    for k, rec in enumerate(records):
        if rec.scope is None:
            near = [scope_of.get(v) for v in rec.node.input] + [
                u.scope for v in rec.node.output for u in users.get(v, [])]
            records[k] = rec._replace(scope=(_common_prefix([s[0] for s in near if s]), "", ""))
            scope_of.update((out, records[k].scope) for out in rec.node.output)


def onnx_graph(path: Path) -> Graph:
    """Read an ONNX model with static shapes into an IR :class:`Graph` (``source="onnx"``).

    Floating-point initializers of more than one element are parameters, named by the torch
    parameter they came from where the exporter's metadata tells; integer initializers, scalars,
    baked-in masks and ``Constant`` outputs are constants. Blocks are left to the caller. Raises
    :class:`CaptureError` naming the file when it is missing, is not ONNX, fails shape inference
    or has dynamic dimensions.
    """
    g = _load(path).graph
    inits = {t.name: t for t in g.initializer}
    metas: dict[str, TensorMeta | str | None] = {
        n: TensorMeta(tuple(t.dims), _dtype(t.data_type)) for n, t in inits.items()}
    for v in [*g.input, *g.value_info, *g.output]:
        metas.setdefault(v.name, _meta(v.type))
    inputs = [GraphInput(v.name, metas[v.name]) for v in g.input if v.name not in inits]
    for inp in inputs:
        if not isinstance(inp.meta, TensorMeta):
            dim = f"the dynamic dimension '{inp.meta}'" if inp.meta else "no static shape"
            raise CaptureError(f"cannot import {path}: input '{inp.name}' has {dim}; re-export "
                               f"with static shapes (torch.onnx.export without dynamic_shapes)")
    consts = set(inits)
    # Floating-point tensors of more than one element may be parameters (masks are sorted out
    # below); index tensors, shape vectors and scalars are constants.
    derived = {n: [n] for n, t in inits.items()
               if _dtype(t.data_type) in _FLOATS and prod(t.dims) > 1}
    producer = {inp.name: inp.name for inp in inputs}
    taken = set(producer)
    records: list[_Rec] = []
    for i, node in enumerate(g.node):
        if node.op_type == "Constant":
            consts.update(node.output)
            continue
        if node.op_type == "Identity" and node.input[0] in inits:
            # The TorchScript exporter keeps one of several equal-valued weights and restores the
            # others' names through Identity: those are distinct torch parameters.
            inits[node.output[0]] = inits[node.input[0]]
            metas[node.output[0]] = metas[node.input[0]]
            consts.add(node.output[0])
            if node.input[0] in derived:
                derived[node.output[0]] = [node.output[0]]
            continue
        name = base = node.name or f"{node.op_type}_{i}"
        while name in taken:
            name = f"{base}_{len(taken)}"
        taken.add(name)
        raws: list[str] = []
        bufs: list[str] = []
        for pos, v in enumerate(node.input):
            # BatchNormalization's running mean and variance are torch buffers, not parameters.
            side = bufs if node.op_type == "BatchNormalization" and pos >= 3 else raws
            side.extend(r for r in derived.get(v, []) if r not in side)
        if node.op_type in _PASS_THROUGH and derived.get(node.input[0]):
            derived[node.output[0]] = derived[node.input[0]]
        scope = _scope(node)
        if scope is None and raws and "." in raws[0]:
            scope = (raws[0].rsplit(".", 1)[0], "", "")
        records.append(_Rec(name, node, raws, bufs, scope))
        producer.update((out, name) for out in node.output)
    _place_unscoped(records)

    def tensor(value: str, node: onnx.NodeProto) -> TensorMeta:
        meta = metas.get(value)
        if isinstance(meta, TensorMeta):
            return meta
        raise CaptureError(f"cannot import {path}: no static shape for '{value}' at node "
                           f"'{node.name}' ({node.op_type}); {_REEXPORT} and static input shapes")

    # Only a tensor no matmul/lookup reads as a weight can be a mask, so few values are read.
    weights = {r for rec in records if rec.node.op_type in _WEIGHT_OPS for r in rec.raws}
    param_set = {n for n in derived if n in inits and (
        n in weights or len(inits[n].dims) == 1 or not _holds_mask(inits[n], str(path.parent)))}
    claimed = {_us(n) for n in inits}
    moe = moe_modules({rec.scope[0] for rec in records})
    used = {v for n in g.node for v in n.input} | {o.name for o in g.output}
    params: dict[str, ParamInfo] = {}
    buffers: dict[str, ParamInfo] = {}
    ops: list[OpNode] = []
    for name, node, raws, bufs, scope in records:
        raws = [r for r in raws if r in param_set]
        ins = [tensor(v, node) for v in node.input if v]
        # An output nobody reads (LayerNormalization's saved mean, say) may stay unshaped.
        outs = [tensor(v, node) for v in node.output
                if v and (v in used or isinstance(metas.get(v), TensorMeta))]
        embeds = node.op_type == "Gather" and bool(param_set & set(derived.get(node.input[0], [])))
        kind, target, flops = _cost(node, ins, outs, bool(raws), embeds, scope, moe)
        names = _param_names(raws, node, scope[0], claimed)
        for fqn, raw in zip(names, raws, strict=True):
            params.setdefault(fqn, ParamInfo(fqn, metas[raw].shape, metas[raw].dtype))
        for raw in (r for r in bufs if r in param_set):
            buffers.setdefault(raw, ParamInfo(raw, metas[raw].shape, metas[raw].dtype, False))
        rd, wr = op_costs.op_bytes(kind, ins, outs, target)
        op = node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}.{node.op_type}"
        ops.append(OpNode(
            name=name, target=op, kind=kind,
            inputs=[producer[v] for v in node.input if v in producer and v not in consts],
            input_meta=ins, output_meta=outs, flops=flops, bytes_read=rd, bytes_written=wr,
            params=names, module_path=scope[0], module_type=scope[1],
        ))
    outputs = [producer[o.name] for o in g.output if o.name in producer]
    return Graph(ops, inputs, params, buffers, outputs, "onnx")
