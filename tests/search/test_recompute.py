"""Exact per-stage recompute choice against brute force over per-block assignments."""

from __future__ import annotations

import itertools
import random

import pytest

from autopar.search.recompute import MODES, ModeCost, choose_recompute


def _random_types(rng: random.Random) -> list[tuple[int, list[ModeCost]]]:
    types = []
    for _ in range(rng.randint(1, 3)):
        none = rng.uniform(50, 100)
        sel = none * rng.uniform(0.3, 0.9)
        op = sel * rng.uniform(0.2, 0.8)
        full = op * rng.uniform(0.05, 0.5)
        costs = [ModeCost(none, 0.0, 0.0),
                 ModeCost(sel, rng.uniform(0, 40), rng.uniform(0.1, 1.0)),
                 ModeCost(op, rng.uniform(10, 60), rng.uniform(0.5, 2.0)),
                 ModeCost(full, rng.uniform(20, 100), rng.uniform(1.0, 3.0))]
        types.append((rng.randint(1, 3), costs))
    return types


@pytest.mark.parametrize("seed", range(30))
def test_choice_matches_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    types = _random_types(rng)
    static, held = rng.uniform(0, 200), rng.choice([1.0, 2.0, 4.0])
    capacity = rng.uniform(100, 1500)
    blocks = [costs for count, costs in types for _ in range(count)]
    best = None
    for modes in itertools.product(range(len(MODES)), repeat=len(blocks)):
        mem = static + held * sum(b[m].activation_bytes for b, m in zip(blocks, modes, strict=True))
        mem += max(b[m].peak_bytes for b, m in zip(blocks, modes, strict=True))
        if mem <= capacity:
            t = sum(b[m].recompute_s for b, m in zip(blocks, modes, strict=True))
            best = t if best is None else min(best, t)
    got = choose_recompute(types, static, held, capacity)
    if best is None:
        assert got is None
    else:
        counts, seconds = got
        assert seconds == pytest.approx(best)
        assert [sum(c.values()) for c in counts] == [n for n, _ in types]
        assert all(set(c) <= set(MODES) for c in counts)


def test_many_blocks_of_many_types_keep_an_exact_three_mode_answer() -> None:
    """Two block types of 40 blocks: four modes' count vectors (12,341 per type, squared) pass
    the enumeration limit, three modes' (861 squared) do not; the choice then leaves ``op`` out
    rather than giving up (which would fall back to full recompute everywhere)."""
    costs = [ModeCost(100.0, 0.0, 0.0), ModeCost(60.0, 5.0, 0.2), ModeCost(30.0, 10.0, 0.5),
             ModeCost(5.0, 20.0, 1.0)]
    types = [(40, costs), (40, costs)]
    got = choose_recompute(types, 0.0, 1.0, 80 * 70.0)
    assert got is not None
    counts, seconds = got
    assert all("op" not in c for c in counts)
    assert [sum(c.values()) for c in counts] == [40, 40]
    assert seconds > 0  # 'none' everywhere (8,000) does not fit 5,600
