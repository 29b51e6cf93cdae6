"""Context parallelism: the ring and all-to-all attention functions against whole-sequence
causal SDPA on 2 and 4 gloo processes, then training through plans from ``autopar.plan``
equal to one process."""

from __future__ import annotations

import pytest

from .harness import run_in_group, spawn_ranks

pytestmark = pytest.mark.dist


def _attention_rank(rank: int, port: int, out, world: int, mode: str, kv_heads: int) -> None:
    run_in_group(rank, port, out, world, _compare_attention, mode, kv_heads)


def _compare_attention(mode: str, kv_heads: int) -> dict[str, float]:
    """The largest difference, over every rank, between this cp attention's output and q/k/v
    gradients on the rank's share and whole-sequence causal SDPA's on the same share."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from autopar.runtime.alltoall_attention import alltoall_attention
    from autopar.runtime.cp_layout import shard_sequence
    from autopar.runtime.ring_attention import ring_attention

    cp, me = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(7)
    batch, heads, seq, dim = 2, 4, 64, 8
    q = torch.randn(batch, heads, seq, dim, generator=g, dtype=torch.float64).float()
    k = torch.randn(batch, kv_heads, seq, dim, generator=g, dtype=torch.float64).float()
    v = torch.randn(batch, kv_heads, seq, dim, generator=g, dtype=torch.float64).float()
    grad = torch.randn(batch, heads, seq, dim, generator=g, dtype=torch.float64).float()
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    F.scaled_dot_product_attention(*whole, is_causal=True,
                                   enable_gqa=kv_heads != heads).backward(grad)
    reference = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                               enable_gqa=kv_heads != heads)
    mine = [shard_sequence(t, me, cp, dim=2).clone().requires_grad_() for t in (q, k, v)]
    attend = ring_attention if mode == "ring" else alltoall_attention
    result = attend(*mine, dist.group.WORLD)
    result.backward(shard_sequence(grad, me, cp, dim=2))
    diffs = {"out": (result - shard_sequence(reference, me, cp, dim=2)).abs().max()}
    for name, local, full in zip("qkv", mine, whole, strict=True):
        diffs["d" + name] = (local.grad - shard_sequence(full.grad, me, cp, dim=2)).abs().max()
    gathered = torch.stack(list(diffs.values())).detach()
    dist.all_reduce(gathered, op=dist.ReduceOp.MAX)
    return dict(zip(diffs, gathered.tolist(), strict=True))


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("mode,kv_heads", [("ring", 2), ("ring", 4), ("alltoall", 2),
                                           ("alltoall", 4)])
def test_cp_attention_equals_whole_sequence_causal_sdpa(world: int, mode: str,
                                                        kv_heads: int) -> None:
    """Forward output and q/k/v gradients of each rank's load-balanced share within 1e-5 of
    causal SDPA over the whole sequence (grouped-query attention: 2 key/value heads for 4
    query heads; under all-to-all on 4 ranks they are replicated per query head)."""
    diffs = spawn_ranks(_attention_rank, world, (world, mode, kv_heads))[0]
    assert max(diffs.values()) < 1e-5, diffs
