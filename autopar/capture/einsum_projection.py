"""Which einsums are linear projections: ``torch.einsum("bsh,oh->bso", x, w)`` with ``w`` a
2-D parameter is ``F.linear(x, w)`` written by hand, and tensor parallelism splits it the same
way (column: ``w`` on its output index; row: on its contracted index, output summed over tp).

The recognised form, shared by the capture (what the solver may split), the plan's placements
(which dim of the weight is split) and the graph pass (what it rewrites on a shard): exactly two
operands, the input first and the 2-D weight second; the weight's two indices distinct, one of
them the input's last index (contracted) and the other absent from the input; the output the
input's indices with the last one replaced by the weight's other index, in the same order. Any
other einsum (batched weights, three operands, a weight used twice, an output that reorders or
sums batch dimensions) is not a projection and stays whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

import torch
from torch import fx

_EINSUM_TARGETS = (torch.ops.aten.einsum.default, torch.einsum)


@dataclass(frozen=True)
class Projection:
    """An einsum projection's weight orientation: ``out_dim`` is the weight dimension that
    indexes output features, ``contracted_dim`` the one summed with the input's last dim."""

    out_dim: int
    contracted_dim: int


def _terms(equation: str) -> tuple[list[str], str] | None:
    """(operand index strings, output index string) with ``...`` kept as ``.``; None when
    the equation is not plain letters."""
    eq = equation.replace(" ", "").replace("...", ".")
    lhs, arrow, out = eq.partition("->")
    ins = lhs.split(",")
    if not arrow:  # implicit output: the indices seen once, in alphabetical order
        letters = [c for c in lhs if c.isalpha()]
        out = ("." if "." in lhs else "") + "".join(
            sorted(c for c in set(letters) if letters.count(c) == 1))
    if not all(c.isalpha() or c == "." for c in "".join(ins) + out):
        return None
    return ins, out


def projection(equation: str, weight_ndim: int = 2) -> Projection | None:
    """The weight orientation when ``equation`` (operands: input, weight) is a projection."""
    terms = _terms(equation)
    if terms is None or weight_ndim != 2:
        return None
    ins, out = terms
    if len(ins) != 2:
        return None
    x, w = ins
    if len(w) != 2 or w[0] == w[1] or "." in w or not x or len(set(x)) != len(x):
        return None
    contracted = x[-1]
    if contracted == "." or contracted not in w:
        return None
    other = w[1 - w.index(contracted)]
    if other in x or out != x[:-1] + other:
        return None
    return Projection(out_dim=w.index(other), contracted_dim=w.index(contracted))


def is_einsum(node: fx.Node) -> bool:
    """Whether ``node`` calls einsum (aten's from torch.export, torch's from fx tracing)."""
    return node.op == "call_function" and node.target in _EINSUM_TARGETS


def einsum_operands(node: fx.Node) -> tuple[str | None, list]:
    """(equation, operands) of an einsum node: aten passes the operands as one list, torch's
    Python function as varargs (or one list)."""
    args = list(node.args)
    equation = args[0] if args and isinstance(args[0], str) else None
    rest = args[1:]
    if len(rest) == 1 and isinstance(rest[0], (list, tuple)):
        rest = list(rest[0])
    return equation, rest


def node_projection(node: fx.Node, weight: fx.Node) -> Projection | None:
    """The projection ``node`` computes with ``weight`` as its second operand, or None (not an
    einsum, not a projection, ``weight`` elsewhere or read twice by it)."""
    if not is_einsum(node):
        return None
    equation, operands = einsum_operands(node)
    val = weight.meta.get("val")
    if equation is None or len(operands) != 2 or operands[1] is not weight or \
            operands[0] is weight or not isinstance(val, torch.Tensor):
        return None
    return projection(equation, val.dim())


def einsum_flops(equation: str, shapes: list[tuple[int, ...]]) -> int | None:
    """Forward FLOPs of a two-operand einsum without ellipsis: a multiply-add (2 FLOPs) per
    point of the space of all its indices. None for any other form."""
    terms = _terms(equation)
    if terms is None or len(terms[0]) != 2 or len(shapes) != 2 or "." in "".join(terms[0]):
        return None
    sizes: dict[str, int] = {}
    for letters, shape in zip(terms[0], shapes, strict=True):
        if len(letters) != len(shape):
            return None
        sizes.update(zip(letters, shape, strict=True))
    return 2 * prod(sizes.values())
