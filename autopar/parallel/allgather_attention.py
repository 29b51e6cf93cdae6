"""All-gather context-parallel attention (Llama 3 paper, arXiv 2407.21783, Sec. 3.3.2;
Megatron-Core's ``cp_comm_type="all_gather"``), the mode
:mod:`autopar.cost.context_parallel` prices as ``allgather``.

Every cp rank gathers the keys and values of the whole sequence (few heads under grouped-query
attention, which is why Llama 3 chose it) and attends its own queries to them: each of its two
chunks (:mod:`autopar.parallel.cp_layout`) to the keys up to its own end, under the causal
mask shifted to the chunk's place. The backward sums every rank's gradient of the gathered
keys and values onto the rank that holds them (a reduce-scatter, here an all-to-all and a sum:
gloo has no reduce-scatter).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from autopar.parallel.comm import outside_selective_checkpoint
from autopar.parallel.cp_layout import chunk_ids, reshard_sequence, unshard_sequence


class GatherSequence(torch.autograd.Function):
    """This rank's share (B, H, S/cp, D) -> the whole sequence (B, H, S, D) in global order,
    gathered over the cp ``group``; the backward returns this rank's share of the gradient
    summed over every rank's."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        cp = dist.get_world_size(group)
        parts = [torch.empty_like(x) for _ in range(cp)]
        with outside_selective_checkpoint():
            dist.all_gather(parts, x.contiguous(), group=group)
        return unshard_sequence(torch.cat(parts, dim=2), cp, dim=2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        cp = dist.get_world_size(ctx.group)
        # piece r of the gradient (rank r's two chunks) goes to rank r, which sums them
        send = torch.stack(reshard_sequence(grad, cp, dim=2).chunk(cp, dim=2)).contiguous()
        received = torch.empty_like(send)
        dist.all_to_all_single(received, send, group=ctx.group)
        return received.sum(0), None


def allgather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, *,
                        scale: float | None = None, causal: bool = True) -> torch.Tensor:
    """Attention of this cp rank's share of the sequence (q (B, Hq, S/cp, D), k and v
    (B, Hkv, S/cp, D), laid out by :mod:`autopar.parallel.cp_layout`) against the whole
    sequence, its keys and values all-gathered over the cp process ``group``."""
    keys, values = GatherSequence.apply(k, group), GatherSequence.apply(v, group)
    gqa = q.shape[1] != k.shape[1]
    if not causal:
        return F.scaled_dot_product_attention(q, keys, values, scale=scale, enable_gqa=gqa)
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    chunk = q.shape[2] // 2
    out = []
    for half, index in zip(q.split(chunk, dim=2), chunk_ids(rank, cp), strict=True):
        start, end = index * chunk, (index + 1) * chunk
        # query i of the chunk sits at start + i and sees keys 0 .. start + i
        mask = torch.ones(chunk, end, dtype=torch.bool, device=q.device).tril(diagonal=start)
        out.append(F.scaled_dot_product_attention(half, keys[:, :, :end], values[:, :, :end],
                                                  attn_mask=mask, scale=scale,
                                                  enable_gqa=gqa))
    return torch.cat(out, dim=2)
