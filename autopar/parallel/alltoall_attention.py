"""All-to-all context-parallel attention (DeepSpeed-Ulysses, Jacobs et al. 2023, arXiv
2309.14509): q, k and v are re-sharded from the sequence to the heads by one all-to-all each,
every cp rank runs ordinary causal attention over the whole sequence on its share of the
heads, and a fourth all-to-all brings the output back to the sequence shards. The backward of
each all-to-all is the inverse all-to-all (:class:`autopar.parallel.cp_comm.AllToAll`).

The sequence shards are laid out as :mod:`autopar.parallel.cp_layout` cuts them (load-balanced
chunks), so the gathered sequence is put back in global order before attention and cut back
after it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from autopar.errors import PlanError
from autopar.parallel.cp_comm import AllToAll
from autopar.parallel.cp_layout import reshard_sequence, unshard_sequence


def alltoall_heads_refusal(query_heads: int, kv_heads: int, cp: int) -> str | None:
    """Why all-to-all attention cannot split these heads over ``cp`` ranks, or None. Query
    heads must divide by cp; key/value heads that do not are replicated per query head."""
    if query_heads % cp:
        return (f"all-to-all context parallelism gives each of the cp={cp} ranks whole heads, "
                f"but the model has {query_heads} query heads; re-plan with cp_mode=ring or a "
                f"cp that divides {query_heads}")
    return None


def _to_heads(x: torch.Tensor, group, cp: int) -> torch.Tensor:
    """(B, H, S/cp, D) sequence shard -> (B, H/cp, S, D) head shard, sequence in global order."""
    return unshard_sequence(AllToAll.apply(x, group, 1, 2), cp, dim=2)


def heads_of_group(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v re-sharded from this rank's share of the sequence to its share of the heads
    over the whole sequence of the ranks of ``group`` (in global order), key/value heads
    replicated per query head when too few to split; a one-line PlanError when the query
    heads do not divide."""
    n = dist.get_world_size(group)
    reason = alltoall_heads_refusal(q.shape[1], k.shape[1], n)
    if reason is not None:
        raise PlanError(reason)
    if k.shape[1] % n:  # too few key/value heads to split: one copy per query head
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return tuple(_to_heads(t, group, n) for t in (q, k, v))


def back_to_sequence(out: torch.Tensor, group) -> torch.Tensor:
    """Inverse of :func:`heads_of_group` for the attention's output."""
    return AllToAll.apply(reshard_sequence(out, dist.get_world_size(group), dim=2), group, 2, 1)


def alltoall_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, *,
                       scale: float | None = None, causal: bool = True) -> torch.Tensor:
    """Attention of this cp rank's share of the sequence (q (B, Hq, S/cp, D), k and v
    (B, Hkv, S/cp, D), laid out by :mod:`autopar.parallel.cp_layout`) against the whole
    sequence, by all-to-all over the cp process ``group``; returns (B, Hq, S/cp, D)."""
    qh, kh, vh = heads_of_group(q, k, v, group)
    out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=causal, scale=scale,
                                         enable_gqa=qh.shape[1] != kh.shape[1])
    return back_to_sequence(out, group)
