"""Turn a torch.fx graph (from torch.export or fx.symbolic_trace) into an autopar IR Graph."""

from __future__ import annotations

import operator
from collections.abc import Iterable

import torch
import torch.fx as fx

from autopar.capture.einsum_projection import (
    einsum_flops,
    einsum_operands,
    is_einsum,
    node_projection,
)
from autopar.capture.op_costs import base_kind, op_bytes, op_flops, packet_name
from autopar.ir.graph import Graph, GraphInput, OpKind, OpNode, ParamInfo, TensorMeta

_ATTENTION_WORDS = ("attn", "attention")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tensor_metas(value: object) -> list[TensorMeta]:
    """Flatten a node's ``meta['val']`` (tensor, tuple, list) into TensorMetas."""
    out: list[TensorMeta] = []
    if isinstance(value, torch.Tensor):
        out.append(TensorMeta(tuple(int(d) for d in value.shape), dtype_name(value.dtype)))
    elif isinstance(value, (tuple, list)):
        for v in value:
            out.extend(tensor_metas(v))
    return out


def _arg_nodes(args: Iterable) -> list[fx.Node]:
    out: list[fx.Node] = []
    for a in args:
        if isinstance(a, fx.Node):
            out.append(a)
        elif isinstance(a, (tuple, list)):
            out.extend(_arg_nodes(a))
        elif isinstance(a, dict):
            out.extend(_arg_nodes(a.values()))
    return out


def _dropout_is_identity(node) -> bool:
    """Whether ``aten.dropout(input, p, train)`` returns its input unchanged: ATen's
    ``at::dropout`` (aten/src/ATen/native/Dropout.cpp) returns the input itself when ``p`` is 0
    or ``train`` is false, so no mask is drawn or saved."""
    args = list(node.args) + [None] * 3
    p = node.kwargs.get("p", args[1])
    train = node.kwargs.get("train", args[2])
    return isinstance(p, (int, float)) and p == 0 or train is False


def _fused_attention_layout(ops_by_name: dict[str, OpNode], src: str,
                            out: TensorMeta) -> bool:
    """Whether ``contiguous`` of ``src`` copies nothing: ``src`` is, through views, a fused
    scaled-dot-product attention's (batch, heads, seq, dim) output transposed to (batch, seq,
    heads, dim), the layout the fused kernels write it in. The efficient kernel allocates
    (B, M, heads, K) and returns it transposed, and the flash kernel allocates its output like
    the query, itself a transposed (batch, seq, heads, dim) projection (torch/_meta_
    registrations.py, ``meta__scaled_dot_product_efficient_attention`` and
    ``meta__scaled_dot_product_flash_attention``); the capture's meta tensors from the
    composite op do not carry that layout."""
    op = ops_by_name.get(src)
    while op is not None and op.kind is OpKind.VIEW and op.inputs:
        op = ops_by_name.get(op.inputs[0])
    if op is None or op.kind is not OpKind.ATTENTION or "scaled_dot_product" not in op.target:
        return False
    shape = tuple(op.output_meta[0].shape)
    return len(shape) == 4 and tuple(out.shape) == (shape[0], shape[2], shape[1], shape[3])


def _target_name(node: fx.Node) -> str:
    """aten ops keep their full name (``aten.linear.default``); Python callables and methods
    from fx.symbolic_trace become ``torch.<name>`` so both share one vocabulary."""
    if node.target is operator.getitem:
        return "<built-in function getitem>"
    if isinstance(node.target, str):  # call_method
        return f"torch.{node.target}"
    if isinstance(node.target, torch._ops.OpOverload | torch._ops.HigherOrderOperator):
        return str(node.target)
    name = getattr(node.target, "__name__", None)
    return f"torch.{name}" if name else str(node.target)


def _module_info(node: fx.Node) -> tuple[str, str]:
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return "", ""
    path, cls = list(stack.values())[-1]
    cls_name = cls if isinstance(cls, str) else getattr(cls, "__name__", str(cls))
    return path, cls_name.rsplit(".", 1)[-1]


def moe_modules(paths: set[str]) -> set[str]:
    """Module paths that own an ``experts`` child: the MoE layers."""
    out = set()
    for p in paths:
        parts = p.split(".")
        if "experts" in parts:
            out.add(".".join(parts[: parts.index("experts")]))
    return out


def refine_kind(kind: OpKind, name: str, path: str, module_type: str, moe: set[str]) -> OpKind:
    """Use the module an op came from to refine the kind its target alone gives."""
    parts = path.split(".") if path else []
    if "experts" in parts and kind is not OpKind.VIEW:
        return OpKind.MOE_EXPERT
    for m in moe:
        if path == m or path.startswith(m + "."):
            rest = path[len(m) + 1:].split(".")[0] if path != m else ""
            if rest in ("gate", "router") or "Router" in module_type:
                return OpKind.MOE_ROUTER if kind is not OpKind.VIEW else kind
            if path == m and name in ("topk", "softmax", "_softmax"):
                return OpKind.MOE_ROUTER
    if kind is OpKind.MATMUL and any(w in p.lower() for p in parts for w in _ATTENTION_WORDS):
        return OpKind.ATTENTION
    if kind in (OpKind.ELEMENTWISE, OpKind.REDUCTION) and "Norm" in module_type:
        return OpKind.NORM
    return kind


def _einsum_facts(node: fx.Node, param_of_placeholder: dict[str, str], used_params: list[str]
                  ) -> tuple[int | None, int | None]:
    """(its weight's output dim when ``node`` is an einsum projection of one parameter read
    by nothing else, else None; its exact FLOPs when the equation gives them)."""
    equation, operands = einsum_operands(node)
    if equation is None:
        return None, None
    shapes = [tuple(o.meta["val"].shape) for o in operands
              if isinstance(o, fx.Node) and isinstance(o.meta.get("val"), torch.Tensor)]
    flops = einsum_flops(equation, shapes) if len(shapes) == len(operands) else None
    weight = operands[-1] if operands else None
    if not isinstance(weight, fx.Node) or used_params != [param_of_placeholder.get(weight.name)]:
        return None, flops  # no parameter, or one reached through a view, or two
    if len(weight.users) != 1:  # one tensor, one layout: a weight read twice stays whole
        return None, flops
    proj = node_projection(node, weight)
    return (proj.out_dim if proj else None), flops


def fx_graph_to_ir(
    graph: fx.Graph,
    param_of_placeholder: dict[str, str],
    buffer_of_placeholder: dict[str, str],
    params: dict[str, ParamInfo],
    buffers: dict[str, ParamInfo],
    source: str,
    model_config: dict | None = None,
) -> Graph:
    """Convert an fx graph whose nodes carry ``meta['val']`` into the IR.

    ``param_of_placeholder`` maps placeholder (or get_attr) node names that are parameters to
    their FQNs; anything reached from a parameter through views and casts still counts as that
    parameter, so ``linear(x, w.t())`` is a linear with parameter ``w``.
    """
    derived: dict[str, list[str]] = {k: [v] for k, v in param_of_placeholder.items()}
    ops_by_name: dict[str, OpNode] = {}
    stateful = set(param_of_placeholder) | set(buffer_of_placeholder)
    inputs: list[GraphInput] = []
    ops: list[OpNode] = []
    paths = {_module_info(n)[0] for n in graph.nodes}
    moe = moe_modules(paths)
    outputs: list[str] = []
    for node in graph.nodes:
        if node.op == "placeholder":
            if node.name not in stateful:
                metas = tensor_metas(node.meta.get("val"))
                if metas:
                    inputs.append(GraphInput(node.name, metas[0]))
            continue
        if node.op == "get_attr":
            continue
        if node.op == "output":
            outputs = [a.name for a in _arg_nodes(node.args)]
            continue
        target = _target_name(node)
        outs = tensor_metas(node.meta.get("val"))
        if not outs:  # asserts, symbolic sizes: no tensor produced
            continue
        args = _arg_nodes(node.args) + _arg_nodes(node.kwargs.values())
        ins: list[TensorMeta] = []
        used_params: list[str] = []
        for a in args:
            ins.extend(tensor_metas(a.meta.get("val")))
            for fqn in derived.get(a.name, []):
                if fqn not in used_params:
                    used_params.append(fqn)
        name = packet_name(target)
        kind = base_kind(target, has_param_operand=bool(used_params))
        if name in ("to", "_to_copy") and ins and ins[0] == outs[0]:
            kind = OpKind.VIEW  # a cast to the same dtype is a no-op
        if name in ("dropout", "feature_dropout") and _dropout_is_identity(node):
            kind = OpKind.VIEW  # ATen's dropout returns its input at p = 0: no mask is kept
        if name == "contiguous" and args and _fused_attention_layout(ops_by_name, args[0].name,
                                                                     outs[0]):
            kind = OpKind.VIEW  # the fused kernel's output is already laid out this way
        weight_out_dim, flops = None, None
        if is_einsum(node):  # a projection is a linear; any other einsum with a weight is not
            weight_out_dim, flops = _einsum_facts(node, param_of_placeholder, used_params)
            if used_params:
                kind = OpKind.LINEAR if weight_out_dim is not None else OpKind.MATMUL
        path, module_type = _module_info(node)
        kind = refine_kind(kind, name, path, module_type, moe)
        if kind is OpKind.VIEW and used_params and len(args) == 1:
            derived[node.name] = used_params  # w.t(), w.view(...) is still w
        rd, wr = op_bytes(kind, ins, outs, target)
        ops_by_name[node.name] = OpNode(
            name=node.name, target=target, kind=kind,
            inputs=[a.name for a in args if a.name not in stateful],
            input_meta=ins, output_meta=outs,
            flops=op_flops(target, kind, ins, outs) if flops is None else flops,
            bytes_read=rd, bytes_written=wr, params=used_params,
            module_path=path, module_type=module_type, weight_out_dim=weight_out_dim,
        )
        ops.append(ops_by_name[node.name])
    return Graph(ops, inputs, params, buffers, outputs, source, model_config)
