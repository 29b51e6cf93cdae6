"""How a split tensor moves through a layer's exported graph, and the graph rewritten to run on
one rank's shards (the pass behind :mod:`autopar.parallel.graph_tp`, and the search's check
that a layout runs, :mod:`autopar.capture.layer_graph`).

A tensor of the graph is either whole on every rank (``None``) or a :class:`Split`: along one
dimension, read as ``prefix x factor x suffix`` in row-major order, each rank holds a
contiguous ``1/tp`` block of the middle factor. ``prefix`` carries fused projections (q, k and
v side by side: ``prefix=3``, each rank its share of each) and merged dimensions (nn.
MultiheadAttention's ``batch x heads``); ``suffix`` carries a head's own size after heads and
head size are merged. Views are followed by place value: the factor keeps its place in the
row-major order whatever dimensions the view makes, and lands on the one output dimension
that holds its leading part.

Every op that meets a split tensor must be one of the rules below; anything else refuses the
layout with the op named (the plan then has to be re-made with tp=1 for that model).
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, replace

import torch
from torch import fx

from autopar.capture.einsum_projection import einsum_operands, is_einsum

aten = torch.ops.aten


@dataclass(frozen=True)
class Split:
    """Each rank holds a contiguous block of ``factor`` inside dimension ``dim`` (global size
    ``prefix * factor * suffix``), or, with ``parts``, its share of each unequal part."""

    dim: int
    prefix: int = 1
    factor: int = 1
    suffix: int = 1
    parts: tuple[int, ...] | None = None


# ops that keep every dimension where it is, whatever the other operands (broadcast) are
_SAME_SHAPE = {aten.dropout.default, aten._to_copy.default,
               aten.to.dtype, aten.to.dtype_layout, aten.clone.default,
               aten.contiguous.default, aten.alias.default, aten.detach.default,
               aten.type_as.default, aten.masked_fill.Scalar, aten.masked_fill.Tensor,
               aten.where.self}
_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default,
          aten.unflatten.int, aten.flatten.using_ints}
_SPLITS = {aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default,
           aten.unsafe_split.Tensor}
_SDPA = {aten.scaled_dot_product_attention.default}
_BATCHED_MATMUL = {aten.matmul.default, aten.bmm.default}


class Refused(Exception):
    """An op the pass cannot run on a split tensor (the message says which and why)."""


def _shape(node: object) -> tuple[int, ...] | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def _norm(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def view_split(split: Split, in_shape: tuple[int, ...], out_shape: tuple[int, ...],
               tp: int) -> Split:
    """Where a split lands after a view from ``in_shape`` to ``out_shape`` (by place value)."""
    if split.parts is not None:
        raise Refused("a view of unequal fused parts (only their split into parts is followed)")
    below = split.suffix * math.prod(in_shape[split.dim + 1:])  # place value of the factor
    top = below * split.factor
    for j, size in enumerate(out_shape):
        lo = math.prod(out_shape[j + 1:])
        hi = lo * size
        if size > 1 and lo < top <= hi:
            start = max(below, lo)
            if top % start or start % lo or hi % top or (top // start) % tp:
                break
            return Split(j, prefix=hi // top, factor=top // start, suffix=start // lo)
    raise Refused(f"a view from {list(in_shape)} to {list(out_shape)} that cuts the split "
                  f"dimension's {tp} blocks apart")


def _local_shape(shape: tuple[int, ...], split: Split, tp: int) -> list[int]:
    out = list(shape)
    out[split.dim] //= tp
    return out


@dataclass
class Collectives:
    """The graph's two Megatron collectives, as modules the rewritten graph calls: ``copy``
    (identity forward, gradient summed over tp: a whole tensor entering split computation)
    and ``reduce`` (value summed over tp, identity backward: a row-parallel linear's
    partial output)."""

    copy: torch.nn.Module
    reduce: torch.nn.Module


def split_graph(gm: fx.GraphModule, kinds: dict[str, str], parts: dict[str, tuple[int, ...]],
                tp: int, collectives: Collectives) -> None:
    """Rewrite ``gm`` in place to run on one tensor-parallel rank's shards.

    ``kinds`` maps a placeholder name to ``"col"`` (an output-feature split weight or bias),
    ``"row"`` (an input-feature split weight); ``parts`` maps a column weight's placeholder to
    its fused parts. Raises :class:`Refused` at the first op it cannot follow."""
    state: dict[fx.Node, object] = {}
    copies: dict[fx.Node, fx.Node] = {}
    graph = gm.graph
    gm.add_submodule("tp_copy", collectives.copy)
    gm.add_submodule("tp_reduce", collectives.reduce)

    def copied(node: fx.Node, before: fx.Node) -> fx.Node:
        if node not in copies:
            with graph.inserting_before(before):
                copies[node] = graph.call_module("tp_copy", (node,))
        return copies[node]

    for node in list(graph.nodes):
        if node.op in ("placeholder", "get_attr"):
            state[node] = None
            continue
        if node.op == "output":
            if any(state.get(a) is not None for a in _flat_nodes(node.args)):
                raise Refused("the layer's output is left split (a column-parallel linear no "
                              "row-parallel one sums)")
            continue
        if node.op != "call_function":
            if any(state.get(a) is not None for a in _flat_nodes(node.args)):
                raise Refused(f"{node.op} {node.target} on a split tensor")
            state[node] = None
            continue
        state[node] = _rule(node, state, kinds, parts, tp, graph, copied)
    graph.lint()
    gm.recompile()


def _flat_nodes(args: object) -> list[fx.Node]:
    out: list[fx.Node] = []
    fx.node.map_arg(args, out.append)
    return out


def _rule(node, state, kinds, parts, tp, graph, copied):  # noqa: C901 - one table
    target, args = node.target, list(node.args)
    inputs = _flat_nodes(node.args) + _flat_nodes(node.kwargs)
    split_in = [a for a in inputs if state.get(a) is not None]
    if target is aten.linear.default:
        return _linear(node, state, kinds, parts, graph, copied)
    if is_einsum(node):
        return _einsum(node, state, kinds, parts, graph, copied)
    if target is operator.getitem:
        src = state.get(args[0])
        if isinstance(src, Split):  # one output of a multi-output op on a split tensor
            raise Refused(f"{args[0].target} (several outputs) on a split tensor")
        return src[args[1]] if isinstance(src, tuple) else None
    if not split_in:
        return None
    first = state[split_in[0]]
    out_shape = _shape(node)
    if target in _SAME_SHAPE or (isinstance(target, torch._ops.OpOverload)
                                 and torch.Tag.pointwise in target.tags):
        return _pointwise(node, inputs, state, first, out_shape, copied)
    if target in _VIEWS:
        new = view_split(first, _shape(args[0]), out_shape, tp)
        node.target = aten.reshape.default
        node.args = (args[0], _local_shape(out_shape, new, tp))
        return new
    if target is aten.transpose.int:
        ndim = len(out_shape)
        d0, d1 = _norm(args[1], ndim), _norm(args[2], ndim)
        dim = d1 if first.dim == d0 else d0 if first.dim == d1 else first.dim
        return replace(first, dim=dim)
    if target is aten.permute.default:
        dims = [_norm(d, len(out_shape)) for d in args[1]]
        return replace(first, dim=dims.index(first.dim))
    if target is aten.unsqueeze.default:
        d = _norm(args[1], len(out_shape))
        return replace(first, dim=first.dim + (d <= first.dim))
    if target in (aten.squeeze.dim, aten.select.int):
        d = _norm(args[1], len(_shape(args[0])))
        if d == first.dim:
            raise Refused(f"{target} on the split dimension")
        return replace(first, dim=first.dim - (d < first.dim))
    if target is aten.expand.default:
        shift = len(out_shape) - len(_shape(args[0]))
        new = replace(first, dim=first.dim + shift)
        sizes = list(args[1])
        if sizes[new.dim] != -1:
            sizes[new.dim] //= tp
        node.args = (args[0], sizes, *args[2:])
        return new
    if target is aten.slice.Tensor:
        return _slice(node, args, first, tp)
    if target in _SPLITS:
        return _split(node, args, first, tp)
    if target in _SDPA:
        return _attention(node, args, state, first)
    if target in (aten.softmax.int, aten._softmax.default, aten.log_softmax.int,
                  aten._log_softmax.default):
        if _norm(args[1], len(out_shape)) == first.dim:
            raise Refused("a softmax over the split dimension")
        return first
    if target is aten.layer_norm.default:
        if first.dim >= len(out_shape) - len(args[1]):
            raise Refused("a norm over the split dimension")
        if any(state.get(a) is not None for a in inputs[1:]):
            raise Refused("a norm with split weights")
        return first
    if target in _BATCHED_MATMUL:
        a, b = (state.get(x) for x in args[:2])
        nd = len(out_shape)
        if a is not None and b is not None and a == b and a.dim < nd - 2:
            return a
        raise Refused("a matmul that contracts or mixes the split dimension")
    raise Refused(f"{target} (not followed on split tensors)")


def _pointwise(node, inputs, state, first, out_shape, copied):
    ndim = len(out_shape)
    for a in inputs:
        s, shape = state.get(a), _shape(a)
        if shape is None:
            continue
        if s is not None:
            if s != first or len(shape) != ndim:
                raise Refused(f"{node.target} on tensors split differently")
            continue
        at = first.dim - (ndim - len(shape))
        if at >= 0 and shape[at] != 1:
            raise Refused(f"{node.target} of a split tensor with a whole one of the same size")
        val = a.meta.get("val")
        if getattr(val, "requires_grad", False):  # its gradient is summed over the split
            node.replace_input_with(a, copied(a, node))
    return first


def _linear(node, state, kinds, parts, graph, copied):
    x, w = node.args[0], node.args[1]
    bias = node.args[2] if len(node.args) > 2 else None
    kind = kinds.get(w.name) if isinstance(w, fx.Node) else None
    xs = state.get(x)
    if kind is None:
        if xs is not None:
            raise Refused("a whole linear on a split input")
        return None
    if kind == "col":
        return _column(node, x, w, xs, parts, copied)
    _check_row_input(x, xs)
    node.args = (x, w)
    out = _summed(node, graph)
    if bias is not None:
        with graph.inserting_after(out):
            added = graph.call_function(aten.add.Tensor, (out, bias))
        out.replace_all_uses_with(added, delete_user_cb=lambda user: user is not added)
    return None


def _einsum(node, state, kinds, parts, graph, copied):
    """An einsum projection (input, split weight) runs on the local shard as written: the
    local weight's sizes give the local output (column) or the partial sum (row). Whole
    einsums pass whole tensors only."""
    _, operands = einsum_operands(node)
    split = [o for o in operands if isinstance(o, fx.Node) and kinds.get(o.name)]
    if not split:
        if any(state.get(o) is not None for o in operands if isinstance(o, fx.Node)):
            raise Refused("an einsum on a split tensor that is not a projection of a split "
                          "weight")
        return None
    # layer_graph.linear_kinds admits only (input, weight) projections split on one index
    x, w = operands
    xs = state.get(x)
    if kinds[w.name] == "col":
        return _column(node, x, w, xs, parts, copied)
    _check_row_input(x, xs)
    _summed(node, graph)
    return None


def _column(node, x, w, xs, parts, copied):
    """A column-parallel projection: the whole input enters (its gradient summed over tp)
    and the output's features are split, part by part when fused."""
    if xs is not None:
        raise Refused("a column-parallel linear on a split input")
    node.replace_input_with(x, copied(x, node))
    ndim = len(_shape(node))
    fused = parts.get(w.name)
    if fused and len(set(fused)) == 1:
        return Split(ndim - 1, prefix=len(fused), factor=fused[0])
    if fused:
        return Split(ndim - 1, parts=tuple(fused))
    return Split(ndim - 1, factor=_shape(node)[-1])


def _check_row_input(x, xs) -> None:
    # row: the input's features split in contiguous blocks, as the weight's columns are
    if xs is None or xs.parts is not None or xs.prefix != 1 or xs.dim != len(_shape(x)) - 1:
        raise Refused("a row-parallel linear whose input is not split along its features")


def _summed(node, graph) -> fx.Node:
    """The row-parallel partial output summed over tp, in place of ``node`` for its users."""
    with graph.inserting_after(node):
        summed = graph.call_module("tp_reduce", (node,))
    node.replace_all_uses_with(summed, delete_user_cb=lambda user: user is not summed)
    return summed


def _slice(node, args, first, tp):
    dim = _norm(args[1], len(_shape(args[0])))
    if dim != first.dim:
        return first
    start, end = (args[2] if len(args) > 2 else 0), (args[3] if len(args) > 3 else None)
    step = args[4] if len(args) > 4 else 1
    size = _shape(args[0])[dim]
    end = size if end is None or end > size else end
    bounds = _part_bounds(first)
    if step != 1 or (start, end) not in bounds:
        raise Refused("a slice of the split dimension that is not one whole fused part")
    part = end - start
    index = bounds.index((start, end))
    local_start = sum(b - a for a, b in bounds[:index]) // tp
    node.args = (args[0], dim, local_start, local_start + part // tp, 1)
    return Split(dim, factor=part) if first.parts else Split(dim, factor=first.factor,
                                                              suffix=first.suffix)


def _part_bounds(split: Split) -> list[tuple[int, int]]:
    sizes = list(split.parts) if split.parts else [split.factor * split.suffix] * split.prefix
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [(s, s + n) for s, n in zip(starts, sizes, strict=True)]


def _split(node, args, first, tp):
    shape = _shape(args[0])
    target = node.target
    dim = _norm(args[2] if len(args) > 2 else 0, len(shape))
    size = shape[dim]
    if target is aten.chunk.default:
        pieces = [math.ceil(size / args[1])] * (size // math.ceil(size / args[1]))
    elif target is aten.split_with_sizes.default:
        pieces = list(args[1])
    else:
        pieces = [args[1]] * (size // args[1]) + ([size % args[1]] if size % args[1] else [])
    if dim != first.dim:
        return tuple(first for _ in pieces)
    bounds = _part_bounds(first)
    starts = [sum(pieces[:i]) for i in range(len(pieces))]
    if [(s, s + n) for s, n in zip(starts, pieces, strict=True)] != bounds:
        raise Refused(f"a split of the split dimension into {pieces}, not its fused parts "
                      f"{[b - a for a, b in bounds]}")
    node.target = aten.split_with_sizes.default
    node.args = (args[0], [n // tp for n in pieces], dim)
    if first.parts:
        return tuple(Split(dim, factor=n) for n in pieces)
    return tuple(Split(dim, factor=first.factor, suffix=first.suffix) for _ in pieces)


def _attention(node, args, state, first):
    q, k, v = (state.get(a) for a in args[:3])
    ndim = len(_shape(node))
    heads = ndim - 3
    if any(s is None or s.dim != heads or s.suffix != 1 or s.parts for s in (q, k, v)):
        raise Refused("attention whose query, key and value are not all split by heads")
    if (q.factor != k.factor or k != v) and (q.prefix != 1 or k.prefix != 1):
        raise Refused("grouped-query attention with heads split in strides")
    mask = args[3] if len(args) > 3 else node.kwargs.get("attn_mask")
    if isinstance(mask, fx.Node):
        shape = _shape(mask)
        at = heads - (ndim - len(shape))
        if state.get(mask) is not None or (at >= 0 and shape[at] != 1):
            raise Refused("an attention mask per head")
    return q
