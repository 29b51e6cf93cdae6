"""The planner's plan is the brute-force optimum of the cost model on small random cases.

Brute force here is written independently of the planner: every mesh, micro-batch size,
sequence-parallel flag, ZeRO stage, schedule, offload set and per-block recompute assignment
is enumerated and costed with autopar.cost.estimate; stage boundaries use the same
FLOP-balanced partition as the planner, and per-op tensor-parallel shardings the layouts that
CP-SAT proves optimal per block type (autopar.search.sharding), solved first.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch

import autopar
from autopar.cost import ParallelConfig, estimate, load_cluster
from autopar.cost.estimate import balanced_stages
from autopar.models import GPT, GPTConfig, token_inputs
from autopar.search.sharding import solve_and_register

OFFLOADS = [(), ("optimizer",), ("activations", "optimizer"), ("optimizer", "params"),
            ("activations", "optimizer", "params")]
CLUSTERS = ["a100-80g", "h100-80g", "v100-16g", "a100-40g", "cpu"]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def brute_force(graph, cluster, devices: int, global_batch: int, capacity: float, heads: int,
                dims: list[int], pins: dict) -> float:
    best = float("inf")
    nblocks = len(graph.blocks)
    for tp, pp in itertools.product(_divisors(devices), _divisors(devices)):
        if devices % (tp * pp) or pp > nblocks or heads % tp or any(d % tp for d in dims):
            continue
        if tp > cluster.devices_per_node:
            continue
        dp = devices // (tp * pp)
        if global_batch % dp:
            continue
        for mb in _divisors(global_batch // dp):
            m = global_batch // dp // mb
            schedules = [("1f1b", 1)] if pp == 1 else [("1f1b", 1), ("zero_bubble", 1),
                                                       ("gpipe", 1)]
            if pp > 1 and m % pp == 0 and nblocks >= 2 * pp:
                schedules.append(("interleaved", 2))
            for sp in ([False, True] if tp > 1 and pp == 1 else [False]):  # runtime's space
                for zero in (range(4) if dp > 1 else [0]):
                    if pins.get("zero_stage", zero) != zero:
                        continue
                    offloads = [()] if "offload" in pins else OFFLOADS
                    for (schedule, v), offload in itertools.product(schedules, offloads):
                        for modes in itertools.product(("none", "selective", "full"),
                                                       repeat=nblocks):
                            config = ParallelConfig(
                                dp=dp, tp=tp, pp=pp, sequence_parallel=sp, zero_stage=zero,
                                microbatch_size=mb, num_microbatches=m, schedule=schedule,
                                virtual_stages=v, recompute=modes, offload=frozenset(offload),
                                stages=balanced_stages(graph, pp))
                            est = estimate(graph, cluster, config)
                            if est.fits(capacity, cluster.node.host_memory_bytes):
                                best = min(best, est.step_time_s)
    return best


def _case(seed: int):
    rng = random.Random(seed)
    heads = rng.choice([2, 4])
    cfg = GPTConfig(vocab_size=rng.choice([128, 512]), seq_len=rng.choice([32, 128, 512]),
                    d_model=heads * rng.choice([16, 32, 64]), n_layers=2, n_heads=heads)
    devices = rng.choice([2, 2, 2, 4])  # 4 devices: a few hundred configurations x 81
    global_batch = rng.choice([2, 4, 8])
    cluster = load_cluster(rng.choice(CLUSTERS))
    with torch.device("meta"):
        model = GPT(cfg)
    graph = autopar.capture(model, token_inputs(1, cfg.seq_len))
    # budgets around what one process needs for one sequence: tight ones force pipeline
    # stages, ZeRO, recompute or offload
    one = estimate(graph, cluster, ParallelConfig(microbatch_size=1))
    capacity = one.memory.total * rng.choice([0.4, 0.6, 0.8, 1.0, 3.0])
    dims = [cfg.d_model * 3, cfg.d_model, cfg.d_model * 4, cfg.vocab_size]
    # some cases pin plain data parallelism's memory (no ZeRO, no offload): recompute must fit it
    pins = {"zero_stage": 0, "offload": "none"} if rng.random() < 0.4 else {}
    return graph, cluster, devices, global_batch, capacity, heads, dims, pins


@pytest.mark.parametrize("seed", range(20))
def test_plan_matches_brute_force(seed: int) -> None:
    graph, cluster, devices, global_batch, capacity, heads, dims, pins = _case(seed)
    solve_and_register(graph, [t for t in _divisors(devices) if heads % t == 0], cluster)
    expected = brute_force(graph, cluster, devices, global_batch, capacity, heads, dims, pins)
    kwargs = dict(devices=devices, cluster=cluster, global_batch=global_batch,
                  memory_limit_gb=capacity / 1e9, constraints=pins)
    if expected == float("inf"):
        with pytest.raises(autopar.InfeasibleError):
            autopar.plan(graph, **kwargs)
        return
    plan = autopar.plan(graph, **kwargs)
    assert plan.predicted.step_time_s == pytest.approx(expected, rel=1e-3)
    assert plan.solver["gap"] == 0.0
