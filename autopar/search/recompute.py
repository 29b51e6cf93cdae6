"""Per-block recompute under a stage's memory budget, exactly.

Within a stage, blocks of one type are interchangeable, so a choice is how many blocks of each
type run with each mode. Memory is ``static + held x sum(activations) + max(recompute peaks)``
and the cost is the sum of recompute times; every count vector is enumerated (vectorised) and
the cheapest one that fits is taken. Minimising each stage's recompute time minimises the step
time too, since step time grows with every stage's time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from autopar.cost.recompute_policy import RECOMPUTE_MODES

MODES = RECOMPUTE_MODES  # most memory first
MAX_COMBINATIONS = 4_000_000


@dataclass(frozen=True)
class ModeCost:
    activation_bytes: float  # stored per micro-batch
    peak_bytes: float  # transient while the block's backward recomputes
    recompute_s: float


def _combinations(types: list[tuple[int, list[ModeCost]]], modes: int) -> int:
    """How many count vectors :func:`choose_recompute` enumerates over ``modes`` modes."""
    total = 1
    for count, _ in types:
        total *= math.comb(count + modes - 1, modes - 1)
    return total


@lru_cache(maxsize=1024)
def _vectors_as_floats(n: int, modes: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`_count_vectors` as floats (for the products with per-mode costs) and, per
    vector, the bit mask of the modes it uses (its recompute peak depends only on that):
    computed once per shape, not once per stage the search tries."""
    opts = _count_vectors(n, modes)
    floats = opts.astype(np.float64)
    masks = ((opts > 0) * (1 << np.arange(modes))[None, :]).sum(axis=1)
    floats.setflags(write=False)
    masks.setflags(write=False)
    return floats, masks


@lru_cache(maxsize=16)
def _mask_bits(modes: int) -> np.ndarray:
    """Row ``mask``: 1.0 where bit j of ``mask`` is set (the modes a set of vectors uses), so
    the recompute peak of each mode set is one row-wise max of the products with the peaks
    (peaks are not negative, so an empty set's is 0)."""
    bits = ((np.arange(1 << modes)[:, None] >> np.arange(modes)[None, :]) & 1).astype(float)
    bits.setflags(write=False)
    return bits


@lru_cache(maxsize=1024)
def _count_vectors(n: int, modes: int) -> np.ndarray:
    """All (c_0, ..., c_{modes-1}) >= 0 summing to n, most 'none' first."""
    if modes == 1:
        return np.array([[n]])
    rows = []
    for first in range(n, -1, -1):
        for rest in _count_vectors(n - first, modes - 1):
            rows.append([first, *rest])
    out = np.array(rows)
    out.setflags(write=False)
    return out


def choose_recompute(types: list[tuple[int, list[ModeCost]]], static_bytes: float, held: float,
                     capacity_bytes: float, allowed: tuple[str, ...] = MODES
                     ) -> tuple[list[dict[str, int]], float] | None:
    """Counts per mode for each (count, per-mode costs) type, or None if nothing fits.

    Returns ([{mode: count} per type], recompute seconds). When every mode's count vectors
    together pass ``MAX_COMBINATIONS`` (many block types of many blocks), mode ``op`` is left
    out of the choice, which keeps the three coarser modes' exact answer.
    """
    key = tuple((count, tuple(costs)) for count, costs in types)
    found = _choose_memo(key, static_bytes, held, capacity_bytes, tuple(allowed))
    if found is None:
        return None
    chosen, seconds = found
    return [dict(c) for c in chosen], seconds


@lru_cache(maxsize=65536)
def _choose_memo(types: tuple, static_bytes: float, held: float, capacity_bytes: float,
                 allowed: tuple[str, ...]) -> tuple[tuple[dict, ...], float] | None:
    """:func:`choose_recompute` once per distinct question: candidates that differ only in
    what a stage's blocks do not see (schedule, stage index, another mesh's same shard) ask it
    again, about four times in five at 512 devices."""
    if "op" in allowed and _combinations(types, len(allowed)) > MAX_COMBINATIONS:
        allowed = tuple(m for m in allowed if m != "op")
    idx = [MODES.index(m) for m in allowed]
    mem = np.zeros(1)
    time = np.zeros(1)
    peak = np.zeros(1)
    options_per_type = []
    for count, costs in types:
        opts = _count_vectors(count, len(idx))
        floats, masks = _vectors_as_floats(count, len(idx))
        a = np.array([costs[i].activation_bytes for i in idx])
        p = np.array([costs[i].peak_bytes for i in idx])
        r = np.array([costs[i].recompute_s for i in idx])
        o_mem = floats @ a
        o_time = floats @ r
        # the peak of each set of used modes (0 for none), read per vector by its mask
        o_peak = (_mask_bits(len(idx)) * p[None, :]).max(axis=1)[masks]
        if len(mem) * len(opts) > MAX_COMBINATIONS:
            return None
        if not options_per_type:  # the first type: its own vectors
            mem, time, peak = o_mem, o_time, np.maximum(o_peak, 0.0)
        else:  # every combination, the earlier types' choice the major index
            mem = (mem[:, None] + o_mem[None, :]).ravel()
            time = (time[:, None] + o_time[None, :]).ravel()
            peak = np.maximum(peak[:, None], o_peak[None, :]).ravel()
        options_per_type.append(opts)
    total = static_bytes + held * mem + peak
    feasible = np.flatnonzero(total <= capacity_bytes)
    if feasible.size == 0:
        return None
    best = feasible[np.argmin(time[feasible])]  # argmin takes the first (most "none") tie
    chosen = []
    picks = np.unravel_index(best, [len(opts) for opts in options_per_type])
    for opts, pk in zip(options_per_type, picks, strict=True):
        vec = opts[int(pk)]
        chosen.append({allowed[j]: int(vec[j]) for j in range(len(idx)) if vec[j]})
    return tuple(chosen), float(time[best])
