"""The serving planner (task="infer"): the mesh, micro-batches and stages with the shortest
decoding step at the planned concurrency and context, or, under a per-token latency bound,
the concurrency with the most tokens per second.

The space is small, so it is searched whole: every legal pp x dp x tp x ep mesh, every split
of a replica's sequences into ``m`` micro-batches (prefilled one at a time: more of them keep
fewer activations live; under pipeline stages they also take turns decoding, each pass
re-reading the stage's weights), and for each the contiguous stages minimising the slowest
stage's decoding time
among those whose weights, caches and prefill activations fit (an exact min-max dynamic
programme). Serving keeps no gradients or optimizer states, so ZeRO, recompute, offload and
the training schedules do not arise; sequence parallelism is not used (a decoding step has one
token to split).
"""

from __future__ import annotations

import time
from dataclasses import replace

from autopar.cost.block_cost import (
    cached_block_cost,
    captured_batch,
    captured_float_bytes,
    captured_seq,
    resolve_precision,
)
from autopar.cost.config import ParallelConfig, TPLayouts
from autopar.cost.estimate import Estimate, estimate, min_max_partition, stage_footprint
from autopar.cost.hardware import Cluster
from autopar.cost.serving import decode_block_times, decode_stages
from autopar.errors import InfeasibleError, PlanError
from autopar.ir.graph import Graph
from autopar.ir.summary import human
from autopar.plan.support import unsupported_serving
from autopar.search.planner import SearchResult, _distinct_alternatives
from autopar.search.robust import robust_choice
from autopar.search.space import Mesh, ModelFacts, divisors, legal_meshes
from autopar.search.spec import Progress, SearchProblem


def serving_search(graph: Graph, facts: ModelFacts, cluster: Cluster, devices: int,
                   global_batch: int, pins: dict, capacity: float, defaults: dict,
                   layouts: dict[int, TPLayouts] | None = None,
                   progress: Progress | None = None, keep: int = 5) -> SearchResult:
    """The serving plan with the shortest decoding step for ``global_batch`` concurrent
    sequences; raises InfeasibleError naming what would fit when none does."""
    started = time.perf_counter()
    rejected: dict[str, int] = {}
    reasons: set[str] = set()
    found: list[tuple[float, tuple, ParallelConfig, Estimate]] = []
    evaluated = 0
    for cross_node in (False, True):
        meshes = legal_meshes(facts, devices, global_batch, cluster.devices_per_node, pins,
                              cross_node)
        for k, mesh in enumerate(meshes):
            if progress and k % 8 == 0:
                progress(k / max(len(meshes), 1), f"{k}/{len(meshes)} meshes")
            for config in _configs(mesh, global_batch, pins, defaults, layouts, rejected,
                                   reasons):
                evaluated += 1
                est = _best_stages(graph, cluster, config, capacity)
                if est is None:
                    rejected["memory"] = rejected.get("memory", 0) + 1
                    continue
                config, estimate_ = est
                tie = (mesh.pp, mesh.ep, -mesh.tp, config.num_microbatches)
                found.append((estimate_.step_time_s, tie, config, estimate_))
        if found:
            break
    if not found:
        raise InfeasibleError(infeasible_serving(graph, facts, cluster, devices, global_batch,
                                                 pins, capacity, defaults, layouts, rejected,
                                                 reasons))
    found.sort(key=lambda f: (f[0], f[1]))
    best = (found[0][2], found[0][3])
    chosen, robust = robust_choice(graph, cluster, "infer", found, best, capacity)
    if progress:
        progress(1.0, "done")
    return SearchResult(chosen[0], chosen[1], _distinct_alternatives(found, chosen[0], keep),
                        best[1].step_time_s, 0.0, evaluated, 0, rejected,
                        time.perf_counter() - started, False, [], best, robust)


def _configs(mesh: Mesh, global_batch: int, pins: dict, defaults: dict,
             layouts: dict[int, TPLayouts] | None, rejected: dict[str, int],
             reasons: set[str]) -> list[ParallelConfig]:
    tp_layouts = (layouts or {}).get(mesh.tp)
    reason = unsupported_serving(
        engine=defaults.get("engine", "autopar"), tp=mesh.tp, pp=mesh.pp, ep=mesh.ep)
    if reason is not None:
        rejected["runtime"] = rejected.get("runtime", 0) + 1
        reasons.add(reason)
        return []
    replica = global_batch // (mesh.dp * mesh.ep)
    out = []
    for m in divisors(replica):
        mb = replica // m
        if pins.get("num_microbatches", m) != m or pins.get("microbatch_size", mb) != mb:
            continue
        out.append(ParallelConfig(dp=mesh.dp, tp=mesh.tp, pp=mesh.pp, ep=mesh.ep,
                                  microbatch_size=mb, num_microbatches=m,
                                  tp_layouts=tp_layouts, **defaults))
    if not out:
        rejected["pinned"] = rejected.get("pinned", 0) + 1
    return out


def _best_stages(graph: Graph, cluster: Cluster, config: ParallelConfig, capacity: float
                 ) -> tuple[ParallelConfig, Estimate] | None:
    """The config with its fastest stages that fit, costed; None when no split fits."""
    if config.pp == 1:
        stages: tuple[tuple[int, int], ...] = ((0, len(graph.blocks)),)
    else:
        fits = _stage_fits(graph, cluster, config, capacity)
        times = [a + b for a, b in decode_block_times(graph, cluster, config)]
        stages = min_max_partition(times, config.pp, lambda i, j, _: fits[i][j])
        if not stages:
            return None
    config = replace(config, stages=stages)
    est = estimate(graph, cluster, config, "infer")
    if any(s.memory.total > capacity for s in est.stages):
        return None
    return config, est


def _stage_fits(graph: Graph, cluster: Cluster, config: ParallelConfig, capacity: float
                ) -> list[list[bool]]:
    """fits[i][j]: whether blocks [i, j) fit one device as a stage (weights, every
    micro-batch's cache, one block's prefill activations, the last stage's logits)."""
    precision = config.precision
    assert precision is not None, "resolve the precision first"
    n = len(graph.blocks)
    static, act = [], []
    for i in range(n):
        c = cached_block_cost(graph, i, config, cluster, "none")
        static.append((c.dense_params + c.expert_params) * precision.param_bytes
                      + c.kv_cache_bytes * config.num_microbatches)
        act.append(c.forward_peak_bytes)
    logits = _last_logits_bytes(graph, config)
    fits = [[False] * (n + 1) for _ in range(n + 1)]
    for j in range(1, n + 1):
        total, peak = 0.0, 0.0
        for i in range(j - 1, -1, -1):
            total += static[i]
            peak = max(peak, act[i])
            need = total + peak + (logits if j == n else 0.0)
            if need > capacity:
                break  # more blocks only need more
            fits[i][j] = True
    return fits


def _last_logits_bytes(graph: Graph, config: ParallelConfig) -> float:
    out = sum(graph.op(n).output_bytes for n in graph.outputs if graph.has_op(n))
    return out * config.microbatch_size / captured_batch(graph) * (
        4 / captured_float_bytes(graph)) / config.tp / max(captured_seq(graph), 1)


def max_concurrency(graph: Graph, cluster: Cluster, config: ParallelConfig,
                    capacity: float) -> int:
    """The most concurrent sequences ``config``'s mesh and stages hold within ``capacity``
    per device, prefilled ``microbatch_size`` at a time: more micro-batches of caches (0 when
    not even one micro-batch fits)."""
    stages = config.stages or decode_stages(graph, cluster, config)

    def fits(m: int) -> bool:
        c = replace(config, num_microbatches=m)
        return all(stage_footprint(graph, c, cluster, s, blocks, False)[1].total <= capacity
                   for s, blocks in enumerate(stages))

    if not fits(1):
        return 0
    lo, hi = 1, 2
    while fits(hi) and hi < 1 << 24:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo * config.microbatch_size * config.dp * config.ep


def infeasible_serving(graph: Graph, facts: ModelFacts, cluster: Cluster, devices: int,
                       global_batch: int, pins: dict, capacity: float, defaults: dict,
                       layouts: dict[int, TPLayouts] | None, rejected: dict[str, int],
                       reasons: set[str]) -> str:
    """Why no serving plan fits, and what would: the leanest mesh's memory by kind and the
    most concurrent sequences (or the longest context) any mesh holds."""
    context = captured_seq(graph)
    # any mesh (a concurrency its replicas divide is what the way out proposes)
    meshes = legal_meshes(facts, devices, devices, cluster.devices_per_node,
                          {k: v for k, v in pins.items() if k != "dp"}, True)
    if not meshes:
        if rejected.get("runtime"):
            return (f"no serving plan for {devices} devices that the runtime can run: "
                    f"{'; '.join(sorted(reasons))}; relax those constraints")
        return (f"no legal serving mesh for {devices} devices and {global_batch} concurrent "
                f"sequences (projection sizes {list(facts.split_dims)}, {facts.blocks} blocks); "
                f"use a concurrency divisible by the data-parallel degree or other constraints")
    best_fit, best_mesh = 0, None
    lean = None
    for mesh in meshes:
        config = resolve_precision(ParallelConfig(
            dp=mesh.dp, tp=mesh.tp, pp=mesh.pp, ep=mesh.ep,
            tp_layouts=(layouts or {}).get(mesh.tp), **defaults), cluster)
        fit = max_concurrency(graph, cluster, config, capacity)
        if fit > best_fit:
            best_fit, best_mesh = fit, mesh
        replica = -(-global_batch // (mesh.dp * mesh.ep))
        at_batch = replace(config, num_microbatches=replica)  # prefilled one at a time
        stages = decode_stages(graph, cluster, at_batch)
        mems = [stage_footprint(graph, at_batch, cluster, s, b, False)[1]
                for s, b in enumerate(stages)]
        worst = max(mems, key=lambda mb: mb.total)
        if lean is None or worst.total < lean[0].total:
            lean = (worst, mesh)
    assert lean is not None
    mem, mesh = lean
    shape = f"pp={mesh.pp} dp={mesh.dp} tp={mesh.tp} ep={mesh.ep}"
    head = (f"no serving plan fits {human(capacity, 'B')} per device on {devices} x "
            f"{cluster.name} for {global_batch} concurrent sequences of {context} tokens: the "
            f"leanest mesh ({shape}) needs {human(mem.total, 'B')} per device (weights "
            f"{human(mem.params, 'B')}, KV cache {human(mem.kv_cache, 'B')}, activations "
            f"{human(mem.activations + mem.buffers, 'B')})")
    if best_fit == 0:
        return (f"{head}; the weights alone do not fit: use more devices or a device with "
                f"more memory")
    room = capacity - mem.params - mem.buffers
    per_token = (mem.kv_cache + mem.activations) / context
    tokens = int(room / per_token) if per_token > 0 else 0
    fit_shape = f"pp={best_mesh.pp} dp={best_mesh.dp} tp={best_mesh.tp} ep={best_mesh.ep}"
    longer = f", or about {tokens} tokens each at {global_batch}" if 0 < tokens < context else ""
    return (f"{head}; at most {best_fit} concurrent sequences of {context} tokens fit "
            f"({fit_shape}){longer}: lower global_batch to {best_fit}, shorten seq, or use "
            f"more devices")


def serving_plan_search(problem: SearchProblem, max_token_latency_ms: float | None = None,
                        progress: Progress | None = None) -> tuple[SearchResult, int]:
    """The serving plan and its concurrency: ``problem.global_batch`` sequences at the
    shortest decoding step, or, with ``max_token_latency_ms``, the concurrency up to
    ``global_batch`` (itself or a power of two below it) with the most tokens per second among
    the plans whose decoding step stays within the bound."""
    graph, facts, cluster, devices = problem.graph, problem.facts, problem.cluster, \
        problem.devices
    global_batch, pins, capacity = problem.global_batch, problem.pins, problem.capacity
    defaults, layouts = problem.defaults, problem.layouts
    if max_token_latency_ms is None:
        return serving_search(graph, facts, cluster, devices, global_batch, pins, capacity,
                              defaults, layouts, progress), global_batch
    if not max_token_latency_ms > 0:
        raise PlanError(f"max_token_latency_ms must be positive, got {max_token_latency_ms}")
    bound_s = max_token_latency_ms / 1e3
    tries = sorted({global_batch, *(1 << k for k in range(global_batch.bit_length())
                                    if 1 << k < global_batch)})
    best: tuple[SearchResult, int] | None = None
    fastest: tuple[SearchResult, int] | None = None
    first_error: InfeasibleError | None = None
    for concurrency in tries:
        try:
            result = serving_search(graph, facts, cluster, devices, concurrency, pins,
                                    capacity, defaults, layouts)
        except InfeasibleError as exc:
            first_error = first_error or exc
            continue
        step = result.estimate.step_time_s
        if fastest is None or step < fastest[0].estimate.step_time_s:
            fastest = (result, concurrency)
        if step <= bound_s and (best is None or concurrency / step
                                > best[1] / best[0].estimate.step_time_s):
            best = (result, concurrency)
    if best is not None:
        return best
    if fastest is None:
        assert first_error is not None
        raise first_error
    result, concurrency = fastest
    c = result.config
    raise InfeasibleError(
        f"no serving plan decodes within {max_token_latency_ms:g} ms per token on {devices} x "
        f"{cluster.name}: the fastest takes {result.estimate.step_time_s * 1e3:.3g} ms at "
        f"{concurrency} concurrent sequence{'s' if concurrency > 1 else ''} (pp={c.pp} "
        f"dp={c.dp} tp={c.tp} ep={c.ep}); raise the bound, shorten seq, or use more or faster "
        f"devices")
