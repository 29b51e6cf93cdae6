"""Ring attention (Liu, Zaharia, Abbeel 2023, arXiv 2310.01889) over the context-parallel
process group, with a hand-written backward.

Each cp rank keeps its queries and passes its key/value block around the ring, ``cp - 1``
times; the partial results are combined exactly with their log-sum-exp (the online softmax).
The backward passes the key/value blocks around again, each with the gradient (dK, dV)
accumulated for it so far, which arrives back at its owner after a full turn.

The sequence is laid out as :mod:`autopar.parallel.cp_layout` cuts it (rank ``i`` holds chunks
``i`` and ``2 cp - 1 - i``): under a causal mask each of a rank's two query chunks meets each
of a source rank's two key chunks as a full block (key chunk earlier), a masked diagonal
block (the same chunk) or not at all (key chunk later). Grouped-query attention (fewer
key/value heads) is computed on the shared heads and its gradients summed back onto them.
The math runs in fp32 whatever the inputs' dtype.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from autopar.parallel.comm import outside_selective_checkpoint
from autopar.parallel.cp_comm import RingPass
from autopar.parallel.cp_layout import chunk_ids

FULL, DIAGONAL, SKIP = "full", "diagonal", "skip"


def block_kind(query_chunk: int, key_chunk: int, causal: bool) -> str:
    """How a query chunk attends to a key chunk (global chunk indices) under the mask."""
    if not causal or key_chunk < query_chunk:
        return FULL
    return DIAGONAL if key_chunk == query_chunk else SKIP


def _expand(kv: torch.Tensor, groups: int) -> torch.Tensor:
    """Key/value heads repeated for the query heads that share them (Hugging Face's repeat_kv
    order: query head h reads key/value head h // groups)."""
    return kv if groups == 1 else kv.repeat_interleave(groups, dim=1)


def _fold(grad: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient of :func:`_expand`: each shared head's copies summed."""
    if groups == 1:
        return grad
    b, h, s, d = grad.shape
    return grad.view(b, h // groups, groups, s, d).sum(2)


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, kind: str) -> torch.Tensor:
    s = q @ k.transpose(-1, -2) * scale
    if kind == DIAGONAL:
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1),
                          float("-inf"))
    return s



def _blocks(me: int, source: int, cp: int, chunk: int, causal: bool):
    """The (query rows, key columns, kind) blocks rank ``me``'s two chunks attend to in the
    keys of rank ``source``'s two chunks (``chunk`` tokens each), the skipped ones left out."""
    for i, qc in enumerate(chunk_ids(me, cp)):
        for j, kc in enumerate(chunk_ids(source, cp)):
            kind = block_kind(qc, kc, causal)
            if kind != SKIP:
                yield (slice(i * chunk, (i + 1) * chunk), slice(j * chunk, (j + 1) * chunk),
                       kind)

class RingAttention(torch.autograd.Function):
    """Causal (or full) attention of this rank's queries against the whole sequence's keys and
    values, which travel around the cp ring. q (B, Hq, S/cp, D), k and v (B, Hkv, S/cp, D)."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, scale: float,
                causal: bool) -> torch.Tensor:
        with outside_selective_checkpoint():  # the ring's sends must really run each time
            return RingAttention._forward(ctx, q, k, v, group, scale, causal)

    @staticmethod
    def _forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, scale: float,
                 causal: bool) -> torch.Tensor:
        cp, me = dist.get_world_size(group), dist.get_rank(group)
        groups = q.shape[1] // k.shape[1]
        c = q.shape[2] // 2
        qf = q.float()
        out = torch.zeros_like(qf)
        lse = torch.full(qf.shape[:3], float("-inf"), device=q.device)
        kv = [k, v]
        for step in range(cp):
            ring = RingPass(kv, group) if step < cp - 1 else None  # travels while we compute
            source = (me - step) % cp
            kf, vf = (_expand(t.float(), groups) for t in kv)
            for rows, cols, kind in _blocks(me, source, cp, c, causal):
                s = _scores(qf[:, :, rows], kf[:, :, cols], scale, kind)
                block_lse = torch.logsumexp(s, dim=-1)
                block_out = torch.exp(s - block_lse.unsqueeze(-1)) @ vf[:, :, cols]
                new_lse = torch.logaddexp(lse[:, :, rows], block_lse)
                out[:, :, rows] = (out[:, :, rows] * torch.exp(lse[:, :, rows] - new_lse)
                                   .unsqueeze(-1)
                                   + block_out * torch.exp(block_lse - new_lse).unsqueeze(-1))
                lse[:, :, rows] = new_lse
            if ring is not None:
                kv = ring.wait()
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.scale, ctx.causal = group, scale, causal
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        group, scale, causal = ctx.group, ctx.scale, ctx.causal
        cp, me = dist.get_world_size(group), dist.get_rank(group)
        groups = q.shape[1] // k.shape[1]
        c = q.shape[2] // 2
        qf, dout = q.float(), grad_out.float()
        delta = (dout * out).sum(-1)  # rowsum(dO * O): the softmax backward's correction
        dq = torch.zeros_like(qf)
        kv = [k, v]
        dkv = [torch.zeros_like(k, dtype=torch.float32), torch.zeros_like(v, dtype=torch.float32)]
        for step in range(cp):
            ring = RingPass(kv, group) if step < cp - 1 else None
            source = (me - step) % cp
            kf, vf = (_expand(t.float(), groups) for t in kv)
            dk, dv = torch.zeros_like(kf), torch.zeros_like(vf)
            for rows, cols, kind in _blocks(me, source, cp, c, causal):
                p = torch.exp(_scores(qf[:, :, rows], kf[:, :, cols], scale, kind)
                              - lse[:, :, rows].unsqueeze(-1))
                dv[:, :, cols] += p.transpose(-1, -2) @ dout[:, :, rows]
                ds = p * (dout[:, :, rows] @ vf[:, :, cols].transpose(-1, -2)
                          - delta[:, :, rows].unsqueeze(-1))
                dq[:, :, rows] += ds @ kf[:, :, cols] * scale
                dk[:, :, cols] += ds.transpose(-1, -2) @ qf[:, :, rows] * scale
            dkv = [dkv[0] + _fold(dk, groups), dkv[1] + _fold(dv, groups)]
            if ring is not None:  # the next block is in before its gradients are sent on
                kv = ring.wait()
            if cp > 1:  # the gradients follow their block; after a full turn they are home
                dkv = RingPass(dkv, group).wait()
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, *,
                   scale: float | None = None, causal: bool = True) -> torch.Tensor:
    """Attention of this cp rank's share of the sequence (q (B, Hq, S/cp, D), k and v
    (B, Hkv, S/cp, D), laid out by :mod:`autopar.parallel.cp_layout`) against the whole
    sequence, over the cp process ``group``: what ``F.scaled_dot_product_attention`` with
    ``is_causal=causal`` gives on the whole sequence, for this rank's rows."""
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads do not share {k.shape[1]} key/value heads "
                         f"evenly")
    if q.shape[2] % 2 or k.shape[2] != q.shape[2]:
        raise ValueError(f"each cp rank holds two equal chunks of the sequence: {q.shape[2]} "
                         f"query and {k.shape[2]} key tokens here (cut with cp_layout)")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return RingAttention.apply(q, k, v, group, scale, causal)
