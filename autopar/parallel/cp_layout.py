"""How context parallelism cuts a sequence over ``cp`` ranks, with causal load balancing.

The sequence is cut into ``2 cp`` equal chunks and rank ``i`` holds chunks ``i`` and
``2 cp - 1 - i`` (Megatron-Core's layout, the one :mod:`autopar.cost.context_parallel`
prices): under a causal mask an early chunk attends to few keys and a late one to many, so
pairing them gives every rank the same attention work. Input ids, labels and position ids are
cut alike; the position ids stay the global positions, so rotary tables match one process.
"""

from __future__ import annotations

import torch

from autopar.errors import PlanError


def chunk_ids(rank: int, cp: int) -> tuple[int, int]:
    """The two global chunk indices (of ``2 cp``) that context-parallel rank ``rank`` holds."""
    return rank, 2 * cp - 1 - rank


def check_divisible(seq: int, cp: int) -> None:
    """Raise PlanError (one line) unless a ``seq``-token sequence cuts into ``2 cp`` chunks."""
    if seq % (2 * cp):
        raise PlanError(f"context parallelism cp={cp} cuts each sequence into {2 * cp} equal "
                        f"chunks, but the sequence has {seq} tokens; use a sequence length "
                        f"divisible by {2 * cp} (or re-plan with a smaller cp)")


def shard_sequence(tensor: torch.Tensor, rank: int, cp: int, dim: int = 1) -> torch.Tensor:
    """This rank's share of ``tensor`` along ``dim`` (the sequence): chunks ``rank`` and
    ``2 cp - 1 - rank`` of ``2 cp``, concatenated in that order."""
    if cp == 1:
        return tensor
    check_divisible(tensor.shape[dim], cp)
    chunks = tensor.chunk(2 * cp, dim=dim)
    first, second = chunk_ids(rank, cp)
    return torch.cat([chunks[first], chunks[second]], dim=dim)


def global_positions(seq: int, rank: int, cp: int, device: torch.device | str = "cpu"
                     ) -> torch.Tensor:
    """The global position ids (1, seq / cp) of the tokens this rank holds."""
    return shard_sequence(torch.arange(seq, device=device).unsqueeze(0), rank, cp)


def rank_order(cp: int) -> list[int]:
    """The global chunk indices in the order an all-gather over the cp ranks lays them out
    (rank 0's two chunks, then rank 1's, ...)."""
    return [c for r in range(cp) for c in chunk_ids(r, cp)]


def unshard_sequence(gathered: torch.Tensor, cp: int, dim: int) -> torch.Tensor:
    """The whole sequence in global order from the cp ranks' shares concatenated by rank
    along ``dim`` (what an all-gather or an all-to-all over the cp ranks returns)."""
    chunks = gathered.chunk(2 * cp, dim=dim)
    where = {c: i for i, c in enumerate(rank_order(cp))}
    return torch.cat([chunks[where[c]] for c in range(2 * cp)], dim=dim)


def reshard_sequence(whole: torch.Tensor, cp: int, dim: int) -> torch.Tensor:
    """Inverse of :func:`unshard_sequence`: the whole sequence laid out by rank (each rank's
    two chunks, rank after rank) along ``dim``."""
    chunks = whole.chunk(2 * cp, dim=dim)
    return torch.cat([chunks[c] for c in rank_order(cp)], dim=dim)
