"""Hybrid context-parallel attention (Megatron-Core's ``cp_comm_type="a2a+p2p"``, the mode
:mod:`autopar.cost.context_parallel` prices as ``hybrid``): the cp ranks form groups of ``a``
(the cp ranks of one node); inside a group, all-to-all re-shards q, k and v from the sequence
to the heads (:mod:`autopar.parallel.alltoall_attention`), and across the groups a ring passes
the keys and values (:mod:`autopar.parallel.ring_attention`).

Why the two compose with the load-balanced layout (:mod:`autopar.parallel.cp_layout`): cp rank
``g a + j`` holds chunks ``g a + j`` and ``2 cp - 1 - g a - j`` of ``2 cp``, so group ``g``
together holds two contiguous runs of ``a`` chunks, which are chunks ``g`` and ``2 r - 1 - g``
of the sequence cut in ``2 r`` (``r = cp / a`` groups): after the group's all-to-all each rank
holds exactly the share the ring expects of ring rank ``g``, on ``1/a`` of the heads.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from autopar.errors import PlanError
from autopar.parallel.alltoall_attention import back_to_sequence, heads_of_group
from autopar.parallel.ring_attention import ring_attention


def hybrid_groups(group, all_to_all_ranks: int) -> tuple[object, object]:
    """(this rank's all-to-all group: ``all_to_all_ranks`` consecutive cp ranks, its ring
    group: the ranks at its place in every other all-to-all group) of the cp process
    ``group``. Only the members of each new group take part in making it, so every data-
    parallel replica's cp group splits on its own."""
    cp, me = dist.get_world_size(group), dist.get_rank(group)
    a = all_to_all_ranks
    if not 1 < a < cp or cp % a:
        raise PlanError(f"hybrid context parallelism splits cp={cp} into all-to-all groups of "
                        f"{a} ranks and a ring across them: {a} must divide {cp} and lie "
                        f"strictly between 1 and {cp}; re-plan with cp_mode=ring or alltoall")
    ranks = dist.get_process_group_ranks(group)
    g, j = divmod(me, a)
    inner = dist.new_group([ranks[g * a + i] for i in range(a)], use_local_synchronization=True)
    outer = dist.new_group([ranks[h * a + j] for h in range(cp // a)],
                           use_local_synchronization=True)
    return inner, outer


def hybrid_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inner, outer, *,
                     scale: float | None = None, causal: bool = True) -> torch.Tensor:
    """Attention of this cp rank's share of the sequence (q (B, Hq, S/cp, D), k and v
    (B, Hkv, S/cp, D), laid out by :mod:`autopar.parallel.cp_layout`) against the whole
    sequence: all-to-all over ``inner``, ring over ``outer`` (:func:`hybrid_groups`)."""
    # the group's shares on this rank's heads, laid out as ring rank g's two chunks
    qh, kh, vh = heads_of_group(q, k, v, inner)
    out = ring_attention(qh, kh, vh, outer, scale=scale, causal=causal)
    return back_to_sequence(out, inner)
