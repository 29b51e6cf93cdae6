"""Fitting the cost model to measurements: each fit recovers the numbers its samples were made
from, and the refinements it writes (matmul classes, per-group-size collective fits, shared
compute slots) change the prediction the way their physics says."""

from __future__ import annotations

import math
import random

import pytest

import autopar
from autopar.calibrate import fit
from autopar.cost.comm import Link, ring_time
from autopar.cost.config import ParallelConfig
from autopar.cost.estimate import estimate
from autopar.cost.hardware import load_cluster, parse_cluster
from autopar.cost.pipeline import lone_stage_speedup


def test_ring_fit_recovers_alpha_and_beta_per_kind_and_group_size() -> None:
    rng = random.Random(0)
    truth = {("all_reduce", 2): (2e-4, 8e8), ("all_reduce", 4): (1.5e-3, 3e8),
             ("all_gather", 4): (4e-4, 5e8)}
    samples = []
    for (kind, n), (alpha, beta) in truth.items():
        for nbytes in (1e4, 1e5, 1e6, 4e6, 1.6e7) * 3:
            noise = 1 + rng.uniform(-0.02, 0.02)
            samples.append((kind, n, nbytes, ring_time(kind, nbytes, n, Link(beta, alpha)) * noise))
    fits = fit.ring_fit(samples)
    for (kind, n), (alpha, beta) in truth.items():
        got_alpha, got_beta, calls = fits[f"{kind}@{n}"]
        assert got_alpha == pytest.approx(alpha, rel=0.1) and got_beta == pytest.approx(beta, rel=0.1)
        assert calls == 15
    assert "all_reduce" in fits and fits["all_gather"][2] == 15  # the kinds' pooled fits too
    assert "broadcast" not in fits  # no calls, no fit


def test_ring_fit_keeps_alpha_and_bandwidth_non_negative() -> None:
    # pure bandwidth: time proportional to bytes, the unconstrained fit's alpha would dip < 0
    samples = [("all_reduce", 2, b, b / 1e9 * (0.9 if b < 1e5 else 1.0)) for b in
               (1e4, 1e4, 1e6, 1e6, 1e7, 1e7)]
    alpha, beta, _ = fit.ring_fit(samples)["all_reduce@2"]
    assert alpha >= 0 and beta > 0


def test_calls_of_one_size_make_no_collective_fit() -> None:
    # one gradient bucket per step: any alpha/beta mix explains it, so none is claimed
    one_size = [("all_reduce", 2, 4e6, 5e-3 * (1 + 0.01 * i)) for i in range(6)]
    assert fit.ring_fit(one_size) == {}
    # a second size far enough away makes the fit
    assert "all_reduce@2" in fit.ring_fit(one_size + [("all_reduce", 2, 4e4, 1e-4)] * 3)


def test_matmul_classes_are_flops_over_time_per_decade() -> None:
    peak = {"fp32": 1e11, "bf16": 2e11}
    calls = [[64, 64, 64, 4, 2 * 64 ** 3 / (0.2e11)]] * 4  # 5e5 FLOPs at 20% of fp32 peak
    calls += [[512, 512, 512, 4, 2 * 512 ** 3 / 0.6e11]] * 3  # 2.7e8 FLOPs at 60%
    calls += [[512, 512, 512, 2, 2 * 512 ** 3 / 1.0e11]] * 3  # bf16: 50% of its peak
    calls += [[8, 8, 8, 4, 1e-3]] * 2  # too few calls for a class of their own
    classes = fit.matmul_classes(calls, peak)
    assert [c[0] for c in classes] == [1e6, 1e30]  # the largest measured class covers the rest
    assert classes[0][1] == pytest.approx(0.2)
    # the class's calls' FLOPs over their seconds at each dtype's peak: (6 + 3) / (10 + 6)
    at_peak = 3 * 2 * 512 ** 3 / 1e11 + 3 * 2 * 512 ** 3 / 2e11
    spent = 3 * 2 * 512 ** 3 / 0.6e11 + 3 * 2 * 512 ** 3 / 1.0e11
    assert classes[1][1] == pytest.approx(at_peak / spent)


def test_fit_scalar_finds_the_value_that_matches_the_measurements() -> None:
    measured = [0.5, 1.1]

    def predict(x: float) -> list[float]:
        return [0.2 + 3000 * x, 0.4 + 7000 * x]

    x = fit.fit_scalar(predict, measured, 0.0, 1e-3)
    best = min((sum((math.log(p) - math.log(m)) ** 2 for p, m in zip(predict(v), measured,
                                                                       strict=True)), v)
               for v in (i * 1e-6 for i in range(1001)))[1]
    assert x == pytest.approx(best, abs=2e-6)


def test_overlap_share() -> None:
    assert fit.overlap_share([(1.0, 0.9), (2.0, 1.2), (1.0, 0.9)]) == pytest.approx(0.75)
    assert fit.overlap_share([(1.0, 1.0)]) is None  # too few calls to say


def _cpu_profile(devices: int, slots: int) -> dict:
    import yaml

    from autopar._paths import data_dir

    data = yaml.safe_load((data_dir("cost_models") / "cpu.yaml").read_text())
    data["node"].update(devices_per_node=devices, compute_slots=slots)
    return data


def test_shared_compute_slots_speed_up_lone_pipeline_stages_only() -> None:
    graph = autopar.capture("tiny-llama", seq=32)
    shared = parse_cluster(_cpu_profile(4, 2), "shared")
    own = parse_cluster(_cpu_profile(4, 4), "own")
    pp4 = ParallelConfig(pp=4, microbatch_size=1, num_microbatches=8, schedule="gpipe")
    dp4 = ParallelConfig(dp=4, microbatch_size=2, num_microbatches=1)
    assert lone_stage_speedup(pp4, shared) == 2.0  # one process alone gets a whole core
    assert lone_stage_speedup(ParallelConfig(pp=2, dp=2, num_microbatches=4), shared) == 2.0
    assert lone_stage_speedup(pp4, own) == 1.0 and lone_stage_speedup(dp4, shared) == 1.0
    assert lone_stage_speedup(pp4, load_cluster("a100-80g")) == 1.0
    # data parallelism keeps every process busy: the slots change nothing
    assert estimate(graph, shared, dp4).step_time_s == estimate(graph, own, dp4).step_time_s
    fast, slow = estimate(graph, shared, pp4), estimate(graph, own, pp4)
    assert fast.step_time_s < slow.step_time_s
    # but no faster than the node's work spread over its slots
    work = 8 * sum(s.fwd_s + s.bwd_s for s in fast.stages) / 4
    assert fast.step_time_s >= work


def test_group_size_fits_win_over_the_kinds() -> None:
    data = _cpu_profile(4, 2)
    data["collectives"] = {"all_reduce": {"alpha": 1e-4, "beta": 1e9,
                                          "by_ranks": {4: {"alpha": 5e-3, "beta": 1e8}}}}
    cluster = parse_cluster(data, "fits")
    from autopar.cost.comm import axis_collective_time

    two = axis_collective_time("all_reduce", 1e6, ParallelConfig(tp=2), "tp", cluster)
    four = axis_collective_time("all_reduce", 1e6, ParallelConfig(tp=4), "tp", cluster)
    assert two == pytest.approx(ring_time("all_reduce", 1e6, 2, Link(1e9, 1e-4)))
    assert four == pytest.approx(ring_time("all_reduce", 1e6, 4, Link(1e8, 5e-3)))
