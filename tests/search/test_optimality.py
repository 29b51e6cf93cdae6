"""The planner finds the brute-force optimum of the cost model on small random cases.

Brute force here is written independently of the planner: every mesh (expert parallelism
included), micro-batch size, sequence-parallel flag, ZeRO stage, schedule (interleaved with
every number of model chunks the planner tries), offload set, contiguous stage partition and
per-block recompute assignment is enumerated and costed with autopar.cost.estimate; per-op
tensor-parallel layouts are the ones CP-SAT proves optimal per block type
(autopar.search.sharding), solved first. The planner must reach the same fastest step (its
robust choice may then be up to 3% slower, and never more sensitive than the fastest).
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch

import autopar
from autopar.cost import ParallelConfig, estimate, load_cluster
from autopar.cost.precision import default_precision
from autopar.models import GPT, GPTConfig, build_model, load_config, token_inputs
from autopar.plan.support import unsupported
from autopar.search.planner import VIRTUAL_STAGES, sequence_parallel_possible
from autopar.search.robust import MEMORY_RISK_FRACTION, ROBUST_MARGIN
from autopar.search.sharding import solve_layouts
from autopar.search.space import model_facts, offload_choices

CLUSTERS = ["a100-80g", "h100-80g", "v100-16g", "a100-40g", "cpu"]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _partitions(blocks: int, pp: int):
    for cuts in itertools.combinations(range(1, blocks), pp - 1):
        bounds = [0, *cuts, blocks]
        yield tuple(zip(bounds, bounds[1:], strict=False))


def brute_force(graph, cluster, devices: int, global_batch: int, capacity: float,
                pins: dict, layouts: dict) -> float:
    """The fastest fitting plan, tensor-parallel groups inside a node; as the planner does,
    groups across nodes only when nothing fits that way."""
    best = _brute_force(graph, cluster, devices, global_batch, capacity, pins, layouts, False)
    if best == float("inf"):
        best = _brute_force(graph, cluster, devices, global_batch, capacity, pins, layouts, True)
    return best


def _brute_force(graph, cluster, devices: int, global_batch: int, capacity: float,
                 pins: dict, layouts: dict, cross_node: bool) -> float:
    facts = model_facts(graph)
    precision = default_precision(cluster.device)
    best = float("inf")
    nblocks = len(graph.blocks)
    for tp, pp, ep in itertools.product(_divisors(devices), repeat=3):
        if devices % (tp * pp * ep) or pp > nblocks or not facts.tp_ok(tp):
            continue
        if not cross_node and (tp > cluster.devices_per_node or cluster.devices_per_node % tp):
            continue  # tensor-parallel groups stay whole inside a node
        if ep > 1 and not facts.ep_ok(ep):
            continue
        dp = devices // (tp * pp * ep)
        if global_batch % (dp * ep):
            continue
        for mb in _divisors(global_batch // (dp * ep)):
            m = global_batch // (dp * ep) // mb
            schedules = [("1f1b", 1)] if pp == 1 else [("1f1b", 1), ("zero_bubble", 1),
                                                       ("gpipe", 1)]
            if pp > 1 and m % pp == 0:
                schedules += [("interleaved", v) for v in VIRTUAL_STAGES if v * pp <= nblocks]
            sp_ok = sequence_parallel_possible(graph, facts, layouts.get(tp), tp)
            for sp in ([False, True] if sp_ok else [False]):
                for zero in (range(4) if dp * ep > 1 else [0]):
                    if pins.get("zero_stage", zero) != zero:
                        continue
                    offloads = [()] if "offload" in pins else offload_choices(cluster.device.type,
                                                                              True)
                    for (schedule, v), offload in itertools.product(schedules, offloads):
                        base = ParallelConfig(
                            dp=dp, tp=tp, pp=pp, ep=ep, sequence_parallel=sp, zero_stage=zero,
                            microbatch_size=mb, num_microbatches=m, schedule=schedule,
                            virtual_stages=v, offload=frozenset(offload), precision=precision,
                            tp_layouts=layouts.get(tp))
                        if unsupported(base):
                            continue
                        for stages in _partitions(nblocks, pp):
                            for modes in itertools.product(("none", "selective", "full"),
                                                           repeat=nblocks):
                                config = ParallelConfig(**{**base.__dict__, "stages": stages,
                                                           "recompute": modes})
                                if unsupported(config):
                                    continue
                                est = estimate(graph, cluster, config)
                                if est.fits(capacity, cluster.node.host_memory_bytes):
                                    best = min(best, est.step_time_s)
    return best


def _case(seed: int):
    rng = random.Random(seed)
    if seed % 4 == 3:  # a two-layer tiny Mixtral: expert parallelism in the space
        config = {**load_config("tiny-mixtral"), "num_hidden_layers": 2}
        graph = autopar.capture(build_model(config), token_inputs(1, rng.choice([16, 32])))
    else:
        heads = rng.choice([2, 4])
        cfg = GPTConfig(vocab_size=rng.choice([128, 512]), seq_len=rng.choice([32, 128, 512]),
                        d_model=heads * rng.choice([16, 32, 64]), n_layers=2, n_heads=heads)
        with torch.device("meta"):
            model = GPT(cfg)
        graph = autopar.capture(model, token_inputs(1, cfg.seq_len))
    devices = rng.choice([2, 2, 2, 4])
    global_batch = rng.choice([2, 4, 8])
    cluster = load_cluster(rng.choice(CLUSTERS))
    # budgets around what one process needs for one sequence: tight ones force pipeline
    # stages, ZeRO, recompute or offload
    one = estimate(graph, cluster, ParallelConfig(microbatch_size=1))
    capacity = one.memory.total * rng.choice([0.4, 0.6, 0.8, 1.0, 3.0])
    # some cases pin plain data parallelism's memory (no ZeRO, no offload): recompute must fit it
    pins = {"zero_stage": 0, "offload": "none"} if rng.random() < 0.4 else {}
    return graph, cluster, devices, global_batch, capacity, pins


@pytest.mark.parametrize("seed", range(16))
def test_plan_matches_brute_force(seed: int) -> None:
    graph, cluster, devices, global_batch, capacity, pins = _case(seed)
    facts = model_facts(graph)
    if len(graph.blocks) > 4:
        pytest.skip("brute force over 3^blocks recompute assignments is sized for 4 blocks")
    layouts, _ = solve_layouts(graph, [t for t in _divisors(devices) if facts.tp_ok(t)],
                               cluster, default_precision(cluster.device).compute)
    expected = brute_force(graph, cluster, devices, global_batch, capacity, pins, layouts)
    kwargs = dict(devices=devices, cluster=cluster, global_batch=global_batch,
                  memory_limit_gb=capacity / 1e9, constraints=pins)
    if expected == float("inf"):
        with pytest.raises(autopar.InfeasibleError):
            autopar.plan(graph, **kwargs)
        return
    plan = autopar.plan(graph, **kwargs)
    robust = plan.solver["robust"]
    assert robust["fastest_step_time_s"] == pytest.approx(expected, rel=1e-5)
    assert plan.predicted.step_time_s <= expected * (1 + ROBUST_MARGIN) * (1 + 1e-5)
    if robust.get("passed_over_for_offload"):  # an on-device plan near: offload passed over
        assert not plan.offload
    elif robust["fastest_memory_fraction"] <= MEMORY_RISK_FRACTION:
        assert robust["chosen_worst_case_s"] <= robust["fastest_worst_case_s"] * (1 + 1e-5)
    elif robust["memory_risk"]:  # nothing near left headroom: chosen on sensitivity alone
        assert robust["chosen_worst_case_s"] <= robust["fastest_worst_case_s"] * (1 + 1e-5)
    else:  # the fastest was passed over for its memory (the memory guard)
        assert robust["passed_over_for_memory"] > 0
        assert plan.predicted.memory["total"] <= MEMORY_RISK_FRACTION * capacity * (1 + 1e-6)
    assert plan.solver["gap"] == 0.0
