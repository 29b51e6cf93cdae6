"""The planner's bounds are sound: over random configurations of every kind (pipelines with any
stage partition and interleaving, ZeRO 0-3, offload, expert parallelism, every
precision and engine), no lower bound exceeds what the cost model says."""

from __future__ import annotations

import random

import pytest

import autopar
from autopar.cost import ParallelConfig, estimate, load_cluster
from autopar.cost.block_cost import resolve_precision
from autopar.cost.config import ENGINES, SCHEDULES
from autopar.cost.precision import FP32, Precision
from autopar.search.bounds import candidate_lower_bound, host_lower_bound, memory_lower_bound
from autopar.search.space import OFFLOAD_CHOICES, divisors, model_facts

CLUSTERS = ["a100-80g", "h100-80g", "v100-16g", "cpu"]
PRECISIONS = [None, FP32, Precision("bf16", "bf16", "fp32"),
              Precision("fp16", "fp16", "fp16", loss_scaling=True)]
CASES_PER_MODEL = 400  # x 3 models: 1,200 configurations


@pytest.fixture(scope="module")
def graphs():
    return {name: autopar.capture(name, seq=32) for name in ("tiny-gpt2", "tiny-llama",
                                                             "tiny-mixtral")}


def _random_partition(rng: random.Random, blocks: int, pp: int) -> tuple:
    cuts = sorted(rng.sample(range(1, blocks), pp - 1))
    bounds = [0, *cuts, blocks]
    return tuple(zip(bounds, bounds[1:], strict=False))


def _random_config(rng: random.Random, graph, facts) -> tuple[ParallelConfig, str]:
    n = len(graph.blocks)
    devices = rng.choice([1, 2, 4, 8, 16, 64, 256])
    tp = rng.choice([t for t in divisors(devices) if facts.tp_ok(t) and t <= 8])
    rest = devices // tp
    pp = rng.choice([p for p in divisors(rest) if p <= n])
    rest //= pp
    ep = rng.choice([e for e in divisors(rest) if facts.ep_ok(e)])
    dp = rest // ep
    schedule = rng.choice(SCHEDULES) if pp > 1 else "1f1b"
    m = rng.choice([1, 2, 3, 4, 8])
    v = 1
    if schedule == "interleaved":
        m = pp * rng.choice([1, 2])
        v = rng.choice([v for v in (1, 2, 3, 4) if v * pp <= n])
    # serving plans (task="infer") are searched whole, without these bounds
    task = "train"
    config = ParallelConfig(
        dp=dp, tp=tp, pp=pp, ep=ep, sequence_parallel=tp > 1 and rng.random() < 0.5,
        zero_stage=rng.choice([0, 1, 2, 3]) if task == "train" else 0,
        microbatch_size=rng.choice([1, 2, 4]), num_microbatches=m, schedule=schedule,
        virtual_stages=v,
        recompute=tuple(rng.choice(["none", "selective", "full"]) for _ in range(n)),
        offload=frozenset(rng.choice(OFFLOAD_CHOICES)),
        stages=_random_partition(rng, n, pp), precision=rng.choice(PRECISIONS),
        engine=rng.choice(ENGINES))
    return config, task


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-llama", "tiny-mixtral"])
def test_lower_bounds_never_exceed_the_estimate(graphs, name: str) -> None:
    graph = graphs[name]
    facts = model_facts(graph)
    rng = random.Random(hash(name) % 1000)
    kinds = set()
    kinds_host = set()
    for _ in range(CASES_PER_MODEL):
        config, task = _random_config(rng, graph, facts)
        cluster = load_cluster(rng.choice(CLUSTERS))
        config = resolve_precision(config, cluster)
        est = estimate(graph, cluster, config, task)
        # the configuration fits a device of exactly its own peak memory: what the recompute
        # bound may assume about memory
        capacity = max(s.memory.total for s in est.stages)
        bound = candidate_lower_bound(graph, facts, cluster, config, task, capacity)
        assert bound <= est.step_time_s * (1 + 1e-9), (config, task, cluster.name, bound,
                                                       est.step_time_s)
        floor = memory_lower_bound(graph, facts, cluster, config, task != "infer")
        assert floor <= capacity * (1 + 1e-9), (config, task, floor, capacity)
        host = host_lower_bound(graph, facts, cluster, config, task != "infer")
        assert host <= est.host_bytes_per_node * (1 + 1e-9), (config, host,
                                                              est.host_bytes_per_node)
        kinds_host.add(host > 0)
        kinds.add((config.pp > 1, config.ep > 1, bool(config.offload), task,
                   config.schedule == "interleaved" and config.virtual_stages > 1))
    # the draw covered pipelines, interleaving and offload (and experts for MoE)
    assert {k[0] for k in kinds} == {True, False}
    assert any(k[2] for k in kinds) and any(k[4] for k in kinds)
    assert kinds_host == {True, False}  # the host bound was not always zero
    if name == "tiny-mixtral":
        assert any(k[1] for k in kinds)
