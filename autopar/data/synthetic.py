"""Token batches: a deterministic synthetic source (same global batch for any plan)."""

from __future__ import annotations

import torch


def synthetic_batch(step: int, seed: int, global_batch: int, seq: int, vocab: int
                    ) -> torch.Tensor:
    """``(global_batch, seq + 1)`` token ids, a function of (seed, step) only."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return torch.randint(0, vocab, (global_batch, seq + 1), generator=gen)
