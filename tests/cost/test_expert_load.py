"""The busiest expert-parallel rank's load: the normal-order-statistic formula against a
simulation of uniform routing, and the cost model charging it to the expert GEMMs and the
all-to-all."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

import autopar
from autopar.cost import block_cost as block_cost_module
from autopar.cost.block_cost import block_cost, resolve_precision
from autopar.cost.config import ParallelConfig
from autopar.cost.expert_load import busiest_rank_load, capped_load, expected_max_normal
from autopar.cost.hardware import load_cluster


def test_expected_max_of_normals() -> None:
    assert expected_max_normal(1) == 0.0
    assert expected_max_normal(2) == pytest.approx(1 / math.sqrt(math.pi), rel=1e-6)
    values = [expected_max_normal(n) for n in (2, 4, 8, 16, 64, 256)]
    assert values == sorted(values)
    # below the balls-into-bins leading term sqrt(2 ln n), and closing in on it
    gaps = [math.sqrt(2 * math.log(n)) - e for n, e in zip((2, 4, 8, 16, 64, 256), values,
                                                             strict=True)]
    assert all(g > 0 for g in gaps) and gaps[-1] < gaps[0]


def _simulated_load(tokens: int, k: int, experts: int, ranks: int, trials: int) -> float:
    """Mean over trials of the busiest rank's copies against an even share, every token of
    every rank routed to k distinct experts chosen uniformly (experts placed in blocks)."""
    rng = np.random.default_rng(0)
    per_rank = experts // ranks
    loads = []
    for _ in range(trials):
        scores = rng.random((ranks * tokens, experts))
        chosen = np.argpartition(scores, k, axis=1)[:, :k]
        counts = np.bincount(chosen.ravel() // per_rank, minlength=ranks)
        loads.append(counts.max() / (tokens * k))
    return float(np.mean(loads))


@pytest.mark.parametrize("tokens,k,experts,ranks", [(512, 2, 8, 2), (256, 2, 8, 8),
                                                    (256, 8, 64, 8), (128, 4, 64, 16)])
def test_formula_matches_simulated_uniform_routing(tokens, k, experts, ranks) -> None:
    simulated = _simulated_load(tokens, k, experts, ranks, trials=400)
    predicted = busiest_rank_load(tokens, k, ranks)
    assert predicted > 1.0
    # the excess over an even share within 15% (400 trials; the copies of one token are not
    # quite independent)
    assert predicted - 1 == pytest.approx(simulated - 1, rel=0.15)


def test_no_expert_parallelism_no_excess() -> None:
    assert busiest_rank_load(4096, 2, 1) == 1.0
    assert busiest_rank_load(0, 2, 8) == 1.0


def test_the_cost_model_charges_the_busiest_rank(monkeypatch) -> None:
    """tiny Mixtral under ep2: the MoE block's compute and all-to-all grow by the factor; with
    the factor forced to 1 they are the balanced ones."""
    graph = autopar.capture("tiny-mixtral", seq=32)
    # without the per-kernel floors a tiny model's kernels sit on, the work itself shows
    a100 = load_cluster("a100-80g")
    cluster = replace(a100, device=replace(a100.device, kernel_overhead_s=0.0,
                                           dispatch_overhead_s=0.0))
    config = resolve_precision(ParallelConfig(dp=1, tp=1, pp=1, ep=2, microbatch_size=1),
                               cluster)
    block = next(b for b in graph.blocks if b.role == "layer")
    loaded = block_cost(graph, block, config, cluster, "none")
    monkeypatch.setattr(block_cost_module, "busiest_rank_load", lambda *a: 1.0)
    even = block_cost(graph, block, config, cluster, "none")
    factor = busiest_rank_load(32, 2, 2)
    assert factor > 1.05  # 32 tokens, top-2: a visible excess
    assert loaded.fwd_s > even.fwd_s and loaded.bwd_s > even.bwd_s
    assert loaded.ep_comm_s > even.ep_comm_s


def test_a_capacity_factor_caps_the_busiest_rank() -> None:
    """GShard capacity: ceil(F x seq x k / E) copies per expert and sequence. At F = 1 a
    sequence of 4096 tokens routed top-2 over 8 experts gives each expert exactly its even
    share (1024), so the busiest rank carries one share, not 1 + 1.424 / sqrt(8192); a
    roomier factor leaves the dropless load."""
    load = busiest_rank_load(4096, 2, 8)
    assert load == pytest.approx(1 + expected_max_normal(8) / math.sqrt(8192))
    assert capped_load(load, 1.0, 4096, 2, 8) == 1.0
    assert capped_load(load, 1.25, 4096, 2, 8) == load
    assert capped_load(load, None, 4096, 2, 8) == load
    # 4097 tokens: the capacity rounds up to 1025 copies, 1025 / 1024.25 shares
    assert capped_load(load, 1.0, 4097, 2, 8) == pytest.approx(1025 * 8 / (4097 * 2))


def test_a_planned_capacity_prices_the_capped_load(monkeypatch) -> None:
    """tiny Mixtral under ep2 (32 tokens, top-2: the dropless busiest rank carries 1.07
    shares): with capacity_factor=1 its MoE block costs what a perfectly even load costs; the
    search records the pinned factor in the plan and prices its step no slower."""
    graph = autopar.capture("tiny-mixtral", seq=32)
    a100 = load_cluster("a100-80g")
    cluster = replace(a100, device=replace(a100.device, kernel_overhead_s=0.0,
                                           dispatch_overhead_s=0.0))
    config = resolve_precision(ParallelConfig(ep=2, microbatch_size=1), cluster)
    block = next(b for b in graph.blocks if b.role == "layer")
    dropless = block_cost(graph, block, config, cluster, "none")
    capped = block_cost(graph, block, replace(config, capacity_factor=1.0), cluster, "none")
    monkeypatch.setattr(block_cost_module, "busiest_rank_load", lambda *a: 1.0)
    even = block_cost(graph, block, config, cluster, "none")
    monkeypatch.undo()
    assert capped.fwd_s < dropless.fwd_s and capped.ep_comm_s < dropless.ep_comm_s
    assert (capped.fwd_s, capped.bwd_s, capped.ep_comm_s) == pytest.approx(
        (even.fwd_s, even.bwd_s, even.ep_comm_s))
    pins = dict(ep=2, dp=1, tp=1, pp=1, microbatch_size=1, precision="fp32")
    plans = [autopar.plan(graph, devices=2, global_batch=4, cluster="a100-80g",
                          constraints=dict(pins, **extra))
             for extra in (dict(capacity_factor=1.0), {})]
    assert [p.capacity_factor for p in plans] == [1.0, None]
    assert plans[0].predicted.step_time_s <= plans[1].predicted.step_time_s
