"""Communication primitives with the autograd rule each needs (one place, picotron style).

PyTorch's functional collectives carry autograd too, but their rules do not always match the
parallel layout they are used in (see the field notes on all-reduce); writing the rule next to
the collective keeps the gradient's meaning explicit and testable.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

# private names: torch has no public way to step out of selective checkpointing's modes
from torch.utils._python_dispatch import _disable_current_modes, _get_current_dispatch_mode_stack
from torch.utils.checkpoint import _CachedTorchDispatchMode, _CachingTorchDispatchMode

_SAC_MODES = (_CachingTorchDispatchMode, _CachedTorchDispatchMode)


@contextmanager
def outside_selective_checkpoint() -> Iterator[None]:
    """Run the enclosed communication, and the compute between, outside selective activation
    checkpointing's dispatch modes (when those are the only modes active). Under them every
    op, c10d's sends, receives and all-to-alls included, is cached in the forward and replayed
    in the recompute: a replayed send never reaches its peer, which then waits for ever, and
    integer routing tensors cannot be replayed at all. Outside them the enclosed code is one
    unit: the checkpoint keeps what it saves for backward, and a recompute runs it again
    whole, communication included, on every rank alike."""
    stack = _get_current_dispatch_mode_stack()
    if stack and all(isinstance(mode, _SAC_MODES) for mode in stack):
        with _disable_current_modes():
            yield
    else:
        yield


def _all_to_all(x: torch.Tensor, output_splits: list[int], input_splits: list[int],
                group: dist.ProcessGroup) -> torch.Tensor:
    out = x.new_empty((sum(output_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """Rows of ``x`` go to the ranks of ``group`` in ``input_splits`` chunks; the gradient of
    a row received from rank i belongs to that row on rank i, so the backward is the same
    exchange with the splits swapped."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, output_splits: list[int], input_splits: list[int],
                group: dist.ProcessGroup) -> torch.Tensor:
        ctx.output_splits, ctx.input_splits, ctx.group = output_splits, input_splits, group
        return _all_to_all(x, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_to_all(grad, ctx.input_splits, ctx.output_splits, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, output_splits: list[int], input_splits: list[int],
               group: dist.ProcessGroup) -> torch.Tensor:
    """Differentiable uneven all-to-all over dim 0: send ``input_splits[i]`` rows to rank i of
    ``group``, receive ``output_splits[i]`` rows from it (rows stay in rank order)."""
    return _AllToAll.apply(x, output_splits, input_splits, group)


def exchange_counts(counts: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Even all-to-all of a 1-D integer tensor (no gradient): chunk i goes to rank i, and the
    result holds each rank's chunk for this rank, in rank order. Used to size the uneven
    exchange that follows."""
    out = torch.empty_like(counts)
    dist.all_to_all_single(out, counts.contiguous(), group=group)
    return out


class _CopyToGroup(torch.autograd.Function):
    """Identity forward; the backward sums the gradient over ``group``: the input of a layer
    whose ranks each compute a different part of its output (Megatron's ``f``)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def copy_to_group(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``x`` unchanged, its gradient summed over ``group`` in the backward."""
    return _CopyToGroup.apply(x, group)


class _RowsOfShared(torch.autograd.Function):
    """Rows ``[start, start + count)`` of a weight every rank of ``group`` holds whole; each
    rank's gradient covers only its rows, so the backward places it in a zero gradient of the
    whole weight and sums over ``group``: every rank ends with the whole weight's gradient."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, start: int, count: int,
                group: dist.ProcessGroup) -> torch.Tensor:
        ctx.shape, ctx.start, ctx.count, ctx.group = weight.shape, start, count, group
        return weight.narrow(0, start, count)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        whole = grad.new_zeros(ctx.shape)
        whole.narrow(0, ctx.start, ctx.count).copy_(grad)
        dist.all_reduce(whole, group=ctx.group)
        return whole, None, None, None


def rows_of_shared(weight: torch.Tensor, start: int, count: int,
                   group: dist.ProcessGroup) -> torch.Tensor:
    """Differentiable ``weight[start:start + count]`` of a weight replicated over ``group``
    whose rows the ranks use in parts (see :class:`_RowsOfShared`)."""
    return _RowsOfShared.apply(weight, start, count, group)


class _ReduceFromGroup(torch.autograd.Function):
    """Sum forward over ``group``, identity backward: the partial output of a layer whose
    ranks each hold part of its input features (Megatron's ``g``). Every rank then holds the
    whole output, and its gradient is already whole on every rank."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def reduce_from_group(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``x`` summed over ``group``; the gradient passes through unchanged."""
    return _ReduceFromGroup.apply(x, group)
