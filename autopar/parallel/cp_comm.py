"""The communication context parallelism runs over its process group: passing blocks around
the ring (point-to-point send / receive) and re-sharding by all-to-all, with autograd. Works
on gloo (CPU) and NCCL alike."""

from __future__ import annotations

import torch
import torch.distributed as dist

from autopar.parallel.comm import outside_selective_checkpoint


def ring_neighbours(group) -> tuple[int, int]:
    """(global rank of the next cp rank, global rank of the previous one) on the ring."""
    me, size = dist.get_rank(group), dist.get_world_size(group)
    return (dist.get_global_rank(group, (me + 1) % size),
            dist.get_global_rank(group, (me - 1) % size))


class RingPass:
    """One step around the ring, started now and finished by :meth:`wait`: each of
    ``tensors`` goes to the next cp rank, and same-shaped tensors come from the previous one.
    Sends and receives are posted together (batch_isend_irecv), so no rank waits on another's
    send to post its receive, and the caller computes while they travel."""

    def __init__(self, tensors: list[torch.Tensor], group) -> None:
        nxt, prev = ring_neighbours(group)
        self._sent = [t.contiguous() for t in tensors]  # alive until the sends complete
        self.received = [torch.empty_like(t) for t in self._sent]
        ops = [dist.P2POp(dist.isend, t, nxt, group) for t in self._sent]
        ops += [dist.P2POp(dist.irecv, r, prev, group) for r in self.received]
        self._requests = dist.batch_isend_irecv(ops)

    def wait(self) -> list[torch.Tensor]:
        """The tensors the previous cp rank sent, once every send and receive completed."""
        for request in self._requests:
            request.wait()
        return self.received


def ring_pass(tensors: list[torch.Tensor], group) -> list[torch.Tensor]:
    """Send ``tensors`` to the next cp rank; return what the previous one sent."""
    return RingPass(tensors, group).wait()


def all_to_all(x: torch.Tensor, group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """``x`` cut into ``cp`` pieces along ``scatter_dim``, piece ``j`` sent to cp rank ``j``,
    and the pieces received from every rank concatenated (by rank) along ``gather_dim``.
    No autograd: see :class:`AllToAll`."""
    size = dist.get_world_size(group)
    send = torch.stack(x.chunk(size, dim=scatter_dim)).contiguous()
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    return torch.cat(received.unbind(0), dim=gather_dim)


class AllToAll(torch.autograd.Function):
    """:func:`all_to_all` with autograd: the backward is the inverse all-to-all (scatter and
    gather dimensions swapped) on the gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
        ctx.group, ctx.dims = group, (scatter_dim, gather_dim)
        with outside_selective_checkpoint():
            return all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        scatter_dim, gather_dim = ctx.dims
        return all_to_all(grad, ctx.group, gather_dim, scatter_dim), None, None, None
