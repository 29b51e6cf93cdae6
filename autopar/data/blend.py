"""Blends: several token datasets read as one, each sample drawn from a source in proportion
to its weight.

A blend is written as Megatron-LM writes one, weights and prefixes alternating:
``"0.7 tok/web 0.3 tok/code"`` (weights are normalised). Sample ``i`` of the run (row ``r``
of step ``s``: ``i = s x global_batch + r``) goes to the source whose share is furthest
behind its weight, ``argmax_k (w_k x (i + 1) - n_k(i))`` with ``n_k(i)`` the samples given
to source ``k`` before ``i`` (Megatron-LM's blending rule, megatron/core/datasets/
helpers.cpp ``build_blending_indices``), and reads that source's sample ``n_k(i)`` under the
source's own shuffle. So a blend, like one dataset, is a function of (seed, step,
global_batch, seq) only: the same rows for every plan, and a data-parallel rank reads only
its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from autopar.errors import PlanError

if TYPE_CHECKING:  # dataset.py opens blends: the import runs the other way
    from autopar.data.dataset import TokenDataset


def is_blend(data: str) -> bool:
    """Whether a ``--data`` value names a blend (weights and prefixes alternating)."""
    words = data.split()
    try:
        float(words[0])
    except (ValueError, IndexError):
        return False
    return len(words) > 1


def parse_blend(data: str) -> list[tuple[float, str]]:
    """``[(weight, prefix), ...]`` of a blend, weights normalised to sum to 1."""
    parts = data.split()
    if len(parts) % 2:
        raise PlanError(f"a blend alternates weights and prefixes, like '0.7 tok/web 0.3 "
                        f"tok/code'; got {len(parts)} words in {data!r}")
    pairs = []
    for weight, prefix in zip(parts[::2], parts[1::2], strict=True):
        try:
            w = float(weight)
        except ValueError:
            raise PlanError(f"{weight!r} in the blend {data!r} is not a weight; write "
                            f"weights and prefixes alternating") from None
        if not w > 0:
            raise PlanError(f"the blend's weight for {prefix} is {w}; weights are positive")
        pairs.append((w, prefix))
    total = sum(w for w, _ in pairs)
    return [(w / total, p) for w, p in pairs]


class BlendedTokens:
    """Token datasets read as one (see the module docstring)."""

    def __init__(self, sources: list[tuple[float, TokenDataset]]) -> None:
        if not sources:
            raise PlanError("a blend needs at least one dataset")
        self.weights = np.array([w for w, _ in sources], dtype=np.float64)
        self.weights /= self.weights.sum()
        self.sources = [s for _, s in sources]
        self._choice = np.zeros(0, dtype=np.int32)  # sample -> source
        self._within = np.zeros(0, dtype=np.int64)  # sample -> its index in that source

    @property
    def vocab_size(self) -> int:
        return max(s.vocab_size for s in self.sources)

    @property
    def eos_id(self) -> int | None:
        """The end-of-document token every source shares, else None."""
        ends = {getattr(s, "eos_id", None) for s in self.sources}
        return ends.pop() if len(ends) == 1 else None

    def num_windows(self, seq: int) -> int:
        """Rows of ``seq + 1`` tokens in one pass over every source."""
        return sum(s.num_windows(seq) for s in self.sources)

    def _grow(self, samples: int) -> None:
        """Extend the assignment to the first ``samples`` samples (doubling)."""
        have = len(self._choice)
        if samples <= have:
            return
        n = max(samples, 2 * have, 1024)
        choice = np.empty(n, dtype=np.int32)
        within = np.empty(n, dtype=np.int64)
        choice[:have], within[:have] = self._choice, self._within
        counts = np.bincount(self._choice, minlength=len(self.sources)).astype(np.int64)
        for i in range(have, n):
            k = int(np.argmax(self.weights * (i + 1) - counts))
            choice[i], within[i] = k, counts[k]
            counts[k] += 1
        self._choice, self._within = choice, within

    def _picks(self, step: int, global_batch: int, start: int, count: int):
        first = step * global_batch + start
        self._grow(first + count)
        span = slice(first, first + count)
        return list(zip(self._choice[span].tolist(), self._within[span].tolist(), strict=True))

    def rows(self, step: int, global_batch: int, seq: int, seed: int, start: int,
             count: int) -> torch.Tensor:
        """Rows ``[start, start + count)`` of step ``step``'s global batch."""
        picks = self._picks(step, global_batch, start, count)
        out = [self.sources[k].rows(0, j + 1, seq, seed, j, 1) for k, j in picks]
        return torch.cat(out) if out else torch.zeros((0, seq + 1), dtype=torch.long)

    def loss_mask(self, step: int, global_batch: int, seq: int, seed: int, start: int,
                  count: int) -> torch.Tensor | None:
        """The trained targets of :meth:`rows`' rows (None when no source has a mask)."""
        if all(s.mask is None for s in self.sources):
            return None
        out = []
        for k, j in self._picks(step, global_batch, start, count):
            mask = self.sources[k].loss_mask(0, j + 1, seq, seed, j, 1)
            out.append(mask if mask is not None else torch.ones((1, seq + 1), dtype=torch.bool))
        return torch.cat(out)

    def shares(self, samples: int) -> list[float]:
        """Each source's share of the first ``samples`` samples (what the weights promise)."""
        self._grow(samples)
        counts = np.bincount(self._choice[:samples], minlength=len(self.sources))
        return (counts / max(samples, 1)).tolist()

    def __repr__(self) -> str:
        parts = ", ".join(f"{w:.3g} x {s.prefix}" for w, s in
                          zip(self.weights.tolist(), self.sources, strict=True))
        return f"BlendedTokens({parts})"
