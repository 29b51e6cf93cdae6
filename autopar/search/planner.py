"""Exhaustive search with lower-bound pruning over the plan space, exact under the cost model.

Candidates (mesh x micro-batch x sequence parallel x ZeRO stage x schedule x offload) are
ordered by a lower bound on their step time: the compute and tensor/expert-parallel
communication of one step, with no recompute, spread perfectly over the pipeline stages, plus
the optimizer update and offload streams of the least any device holds. They are evaluated in
that order (the best contiguous stage partition with the cheapest per-block recompute that fits
memory, then the full cost model) until the next lower bound is beyond the best plan found by
more than the robustness margin: everything after it is provably no better. The bound and gap
are reported; with ``time_limit_s`` the search stops early and reports the gap it proved.

Robust choice: among the plans within ``ROBUST_MARGIN`` (3%) of the fastest, the planner picks
the one whose step time suffers least if communication were 1.5x slower or overlap halved (its
worst of the two), and records both the fastest and the choice.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import lru_cache

from autopar.cost.comm import p2p_time
from autopar.cost.config import ParallelConfig, TPLayouts
from autopar.cost.data_parallel import overlapped, step_sync, step_sync_exposed
from autopar.cost.estimate import (
    Estimate,
    cached_block_cost,
    cached_block_traffic,
    estimate,
    p2p_hidden_share,
)
from autopar.cost.hardware import Cluster
from autopar.cost.memory import (
    MemoryBreakdown,
    inflight_microbatches,
    model_state_bytes,
    offload_transfer,
    optimizer_step_time,
)
from autopar.cost.pipeline import fill_drain_factor
from autopar.errors import InfeasibleError
from autopar.ir.graph import Graph
from autopar.search.infeasible import infeasible_message
from autopar.search.recompute import MODES
from autopar.search.space import (
    OFFLOAD_CHOICES,
    SCHEDULES_PP,
    Mesh,
    ModelFacts,
    divisors,
    legal_meshes,
)
from autopar.search.stages import best_partition
from autopar.search.support import unsupported

Progress = Callable[[float, str], None]


@dataclass(order=True)
class Candidate:
    lower_bound_s: float
    tie: tuple  # deterministic preference among equal bounds: simpler plans first
    config: ParallelConfig = field(compare=False)


@dataclass
class SearchResult:
    config: ParallelConfig
    estimate: Estimate
    alternatives: list[tuple[ParallelConfig, Estimate]]
    bound_s: float
    gap: float
    evaluated: int
    pruned_by_bound: int
    rejected: dict[str, int]
    search_time_s: float
    timed_out: bool
    # lower bounds of what memory ruled out: did memory cost speed? (the report asks)
    memory_rejected_bounds: list[float] = field(default_factory=list)
    fastest: tuple[ParallelConfig, Estimate] | None = None  # the nominal optimum
    robust: dict = field(default_factory=dict)  # how the choice among near-optimal plans went


VIRTUAL_STAGES = (2, 3, 4, 6, 8)  # model chunks per device the interleaved schedule tries
ROBUST_MARGIN = 0.03  # plans this close to the fastest compete on sensitivity
COMM_SLOWER = 1.5  # the sensitivity checks: every collective 1.5x slower ...
OVERLAP_SCALE = 0.5  # ... or half of the overlap


def sensitivity(graph: Graph, cluster: Cluster, config: ParallelConfig, task: str
                ) -> dict[str, float]:
    """Step seconds of a plan if communication were 1.5x slower and if overlap were halved."""
    slow = estimate(graph, cluster.perturbed(comm_slower=COMM_SLOWER), config, task)
    half = estimate(graph, cluster.perturbed(overlap_scale=OVERLAP_SCALE), config, task)
    return {"comm_1.5x_s": slow.step_time_s, "overlap_half_s": half.step_time_s}


def _recompute_lower_bound(graph: Graph, facts: ModelFacts, cluster: Cluster,
                           config: ParallelConfig, train: bool, capacity: float,
                           pinned: str | tuple[str, ...] | None) -> float:
    """Recompute seconds per micro-batch, summed over all blocks, that any plan of this
    candidate needs to fit ``capacity``.

    Stage s holds at least its states plus its stored activations times the micro-batches it
    keeps; summed over stages that caps the activations all stages can store, and the rest of
    what no recompute would store must be shed. Every block type offers none -> selective ->
    full steps (bytes saved, seconds spent); the lower convex hull of those steps, filled
    greedily (the LP relaxation of the per-block choice), costs no more than any real choice.
    """
    if not train:
        return 0.0
    if isinstance(pinned, tuple):
        return sum(cached_block_cost(graph, i, config, cluster, mode).recompute_s
                   for i, mode in enumerate(pinned))
    if pinned is not None:
        return sum(len(blocks) * cached_block_cost(graph, blocks[0].index, config, cluster,
                                                   pinned).recompute_s
                   for blocks in graph.block_types().values())
    floor = _states_floor(graph, facts, config, train)
    if "optimizer" in config.offload:
        floor.optimizer = 0.0
    if "params" in config.offload:
        floor.params = 0.0
    held = [inflight_microbatches(config.schedule, config.pp, s, config.num_microbatches,
                                  config.virtual_stages) for s in range(config.pp)]
    if "activations" in config.offload:
        held = [min(h, 1.0) for h in held]
    types = [(blocks[0].index, len(blocks)) for blocks in graph.block_types().values()]
    stored = {mode: [cached_block_cost(graph, i, config, cluster, mode) for i, _ in types]
              for mode in MODES}
    acts = sum(c.activation_bytes * count for c, (_, count) in zip(stored["none"], types,
                                                                    strict=True))
    # stage s keeps held_s micro-batches: its activations are at most (capacity - its states)
    # / held_s; summed over stages, with the states (pp x the floor) placed where they cost
    # the least room, the stages keep at most capacity x sum(1 / held_s) - pp x floor / max(held)
    states = floor.params + floor.grads + floor.optimizer
    room = capacity * sum(1.0 / h for h in held) - config.pp * states / max(held)
    need = acts - room
    if need <= 0:
        return 0.0
    steps: list[tuple[float, float]] = []  # (seconds per byte, bytes) of every hull step
    for t, (_, count) in enumerate(types):
        points = [(0.0, 0.0)] + [
            (stored["none"][t].activation_bytes - stored[mode][t].activation_bytes,
             stored[mode][t].recompute_s) for mode in ("selective", "full")]
        hull = [(0.0, 0.0)]
        for saved, seconds in sorted(points[1:]):
            if saved <= hull[-1][0]:
                continue
            while len(hull) >= 2:
                (a0, t0), (a1, t1) = hull[-2], hull[-1]
                if (t1 - t0) * (saved - a0) >= (seconds - t0) * (a1 - a0):
                    hull.pop()  # not on the lower hull
                else:
                    break
            hull.append((saved, seconds))
        for (a0, t0), (a1, t1) in zip(hull, hull[1:], strict=False):
            steps.append(((t1 - t0) / (a1 - a0), (a1 - a0) * count))
    seconds = 0.0
    for rate, nbytes in sorted(steps):
        take = min(nbytes, need)
        seconds += rate * take
        need -= take
        if need <= 0:
            break
    return seconds


def _lower_bound(graph: Graph, cluster: Cluster, config: ParallelConfig, train: bool,
                 schedule: str = "1f1b", virtual_stages: int = 1,
                 recompute_s: float = 0.0) -> float:
    """No step can be faster: the work of one micro-batch, W, split evenly over p stages, run
    m times, plus the schedule's fill and drain on the even split, (p - 1) W / p x phi
    (:func:`autopar.cost.pipeline.fill_drain_factor`); ``recompute_s`` is a lower bound on the
    recompute memory forces (:func:`_recompute_lower_bound`). With stage times t_i summing to at
    least W the step is at least m max(t) + (sum(t) - max(t)) phi, smallest at max(t) = W / p;
    collectives and recompute only add to it. Per-micro-batch sharded-data-parallel
    collectives beside a pass cost at least ``overlapped(pass compute, collectives)``: the
    overlap formula is homogeneous and concave in the collectives, so the sum over blocks and
    stages is at least the formula on the sums."""
    weight_grad = 0.0
    compute_f = compute_b = gather = reduce = 0.0
    replicated = train and config.dp * config.ep > 1
    zero3 = replicated and config.zero_stage == 3
    reduces = zero3 or (replicated and config.zero_stage == 2 and config.engine == "autopar")
    per_type: dict[int, float] = {}
    smallest_send = float("inf")
    for blocks in graph.block_types().values():
        i, count = blocks[0].index, len(blocks)
        c = cached_block_cost(graph, i, config, cluster, "none")
        # what a block puts on its stage's compute lane (as the estimate's stage_cost does)
        per_type[blocks[0].type_id] = c.fwd_s + c.tp_comm_s + (
            c.bwd_s + c.ep_comm_s if train else c.ep_comm_s / 2)
        smallest_send = min(smallest_send, c.output_bytes)
        weight_grad += count * c.bwd_s / 2 if train else 0.0
        compute_f += count * (c.fwd_s + (c.tp_comm_s / 2 if train else c.tp_comm_s)
                              + c.ep_comm_s / 2)
        if train:
            compute_b += count * (c.bwd_s + c.tp_comm_s / 2 + c.ep_comm_s / 2)
        if reduces:
            traffic = cached_block_traffic(graph, i, config, cluster)
            gather += count * traffic.gather_s if zero3 else 0.0
            reduce += count * traffic.reduce_s
    overlap = cluster.device.overlap
    total = overlapped(compute_f, gather, overlap)
    if train:
        total += overlapped(compute_b + recompute_s, gather + reduce, overlap)
    p, m = config.pp, config.num_microbatches
    phi = fill_drain_factor(schedule, virtual_stages, total, weight_grad,
                            config.num_microbatches, config.pp)
    if p == 1:
        return m * total
    # the slowest stage is at least the average, and at least the best any contiguous split
    # of the blocks' own times achieves
    times = tuple(per_type[b.type_id] for b in graph.blocks)
    bottleneck = max(total / p, _min_max_split(times, p))
    chunks = virtual_stages if schedule == "interleaved" else 1
    send = p2p_time(smallest_send, config, cluster)
    hidden = p2p_hidden_share(config, cluster)
    sends = 2 * (p * chunks - 1) * send + 2 * chunks * m * send * (
        (1 - hidden) + hidden * cluster.device.overlap.compute_slowdown)
    return m * bottleneck + phi * (total - bottleneck) + sends


@lru_cache(maxsize=4096)
def _min_max_split(times: tuple[float, ...], parts: int) -> float:
    """A lower bound (within 1e-9) on the slowest part of the best split of ``times`` into at
    most ``parts`` contiguous parts: bisection on the greedy packing test."""
    lo, hi = max(times), sum(times)
    if parts <= 1 or lo >= hi:
        return hi if parts <= 1 else lo
    for _ in range(60):
        mid = (lo + hi) / 2
        count, run = 1, 0.0
        for t in times:
            if run + t > mid:
                count, run = count + 1, t
            else:
                run += t
        if count <= parts:
            hi = mid
        else:
            lo = mid
        if hi - lo <= 1e-9 * hi:
            break
    return lo


def _states_floor(graph: Graph, facts: ModelFacts, config: ParallelConfig, train: bool
                  ) -> MemoryBreakdown:
    """Parameter, gradient and optimizer bytes that some device holds at least: the model states
    split as evenly as the mesh allows, before offload (the cost model's ZeRO formula)."""
    precision = config.precision
    assert precision is not None
    dense = (graph.num_params - facts.expert_params) / (config.tp * config.pp)
    experts = facts.expert_params / (config.ep * config.pp)
    out = MemoryBreakdown()
    for numel, replicas in ((dense, config.dp * config.ep), (experts, config.dp)):
        if train:
            states = model_state_bytes(numel, replicas, config.zero_stage, precision.param_bytes,
                                       precision.grad_bytes, precision.optimizer_bytes,
                                       config.trainable_fraction)
        else:
            states = MemoryBreakdown(params=numel * precision.param_bytes)
        out.params += states.params
        out.grads += states.grads
        out.optimizer += states.optimizer
    return out


def candidate_lower_bound(graph: Graph, facts: ModelFacts, cluster: Cluster,
                          config: ParallelConfig, task: str, capacity: float,
                          pinned_recompute: str | tuple[str, ...] | None = None) -> float:
    """No plan of this candidate (any stage partition, any per-block recompute that fits
    ``capacity``) has a shorter step: the pipelined work with the least recompute memory
    forces, plus the optimizer update and offload streams of the least any device holds.
    ``config`` must carry its precision."""
    train = task != "infer"
    recompute = _recompute_lower_bound(graph, facts, cluster, config, train, capacity,
                                       pinned_recompute)
    return (_lower_bound(graph, cluster, config, train, config.schedule, config.virtual_stages,
                         recompute)
            + _update_time_lower_bound(graph, facts, cluster, config, train))


def memory_lower_bound(graph: Graph, facts: ModelFacts, cluster: Cluster,
                       config: ParallelConfig, train: bool) -> float:
    """No device of this candidate needs less: the states floor (less what is offloaded) plus a
    1/pp share of the activations every block keeps even under full recompute."""
    floor = _states_floor(graph, facts, config, train)
    if "optimizer" in config.offload:
        floor.optimizer = 0.0
    if "params" in config.offload:
        floor.params = 0.0
    total = floor.params + floor.grads + floor.optimizer
    if train:
        lean = sum(cached_block_cost(graph, i, config, cluster, "full").activation_bytes
                   for i in range(len(graph.blocks)))
        total += lean / config.pp
    return total


def _update_time_lower_bound(graph: Graph, facts: ModelFacts, cluster: Cluster,
                             config: ParallelConfig, train: bool) -> float:
    """The optimizer update, the optimizer/parameter offload streams and the once-per-step
    data-parallel collectives of the least any device holds (the cost model's own functions
    on the states floor)."""
    if not train:
        return 0.0
    floor = _states_floor(graph, facts, config, train)
    _, offload_s = offload_transfer(config, floor, [], config.num_microbatches, cluster,
                                    train, 1.0)
    seconds = offload_s + optimizer_step_time(floor, cluster.device, config.precision)
    replicated = config.dp * config.ep > 1
    per_block = config.zero_stage == 3 or (config.zero_stage == 2 and config.engine == "autopar")
    if replicated and not per_block:
        # the once-per-step gradient reduction of the stage holding the average share of the
        # parameters, beside the whole model's backward: no stage's is shorter
        precision = config.precision
        dense = (graph.num_params - facts.expert_params) / (config.tp * config.pp)
        experts = facts.expert_params / (config.ep * config.pp)
        sync = step_sync(dense, experts, config, cluster, precision.param_bytes,
                         precision.grad_bytes, config.trainable_fraction)
        window = 0.0
        for blocks in graph.block_types().values():
            c = cached_block_cost(graph, blocks[0].index, config, cluster, "none")
            window += len(blocks) * (c.bwd_s + c.tp_comm_s / 2 + c.ep_comm_s / 2)
        seconds += step_sync_exposed(sync, window, cluster.device.overlap)
    return seconds


def candidates(graph: Graph, facts: ModelFacts, cluster: Cluster, devices: int, task: str,
               global_batch: int, pins: dict, allow_cross_node_tp: bool,
               rejected: dict[str, int], defaults: dict,
               layouts: dict[int, TPLayouts] | None = None,
               capacity: float = float("inf")) -> list[Candidate]:
    out: list[Candidate] = []
    meshes = legal_meshes(facts, devices, global_batch, cluster.devices_per_node, pins,
                          allow_cross_node_tp)
    for mesh in meshes:
        replica_batch = global_batch // (mesh.dp * mesh.ep)
        for mb in divisors(replica_batch):
            m = replica_batch // mb
            if pins.get("microbatch_size", mb) != mb or pins.get("num_microbatches", m) != m:
                continue
            for sp in ((False, True) if mesh.tp > 1 else (False,)):
                if pins.get("sequence_parallel", sp) != sp:
                    continue
                base = ParallelConfig(dp=mesh.dp, tp=mesh.tp, pp=mesh.pp, ep=mesh.ep,
                                      sequence_parallel=sp, microbatch_size=mb,
                                      num_microbatches=m,
                                      tp_layouts=(layouts or {}).get(mesh.tp), **defaults)
                out.extend(_knob_variants(graph, cluster, base, mesh, facts, task, pins,
                                          rejected, capacity))
    out.sort()
    return out


def _knob_variants(graph: Graph, cluster: Cluster, base: ParallelConfig, mesh: Mesh,
                   facts: ModelFacts, task: str, pins: dict, rejected: dict[str, int],
                   capacity: float) -> list[Candidate]:
    train = task != "infer"
    replicas = mesh.dp * mesh.ep
    zeros = (0, 1, 2, 3) if train and replicas > 1 else (0,)
    if mesh.pp == 1:
        schedules = [("1f1b", 1)]
    else:
        schedules = []
        for name in SCHEDULES_PP:
            if name == "interleaved":
                # Megatron's interleaved 1F1B: micro-batches in multiples of pp, v model chunks
                # per device (at least one block each)
                if base.num_microbatches % mesh.pp:
                    continue
                for v in VIRTUAL_STAGES:
                    if v * mesh.pp <= facts.blocks and pins.get("virtual_stages", v) == v:
                        schedules.append((name, v))
            elif pins.get("virtual_stages", 1) == 1:
                schedules.append((name, 1))
    offloads = OFFLOAD_CHOICES if train else ((), ("params",))
    out = []
    for zero in zeros:
        if pins.get("zero_stage", zero) != zero:
            continue
        for si, (schedule, v) in enumerate(schedules):
            if pins.get("schedule", schedule) != schedule and mesh.pp > 1:
                continue
            for oi, offload in enumerate(offloads):
                if "offload" in pins and tuple(sorted(pins["offload"])) != offload:
                    continue
                config = replace(base, zero_stage=zero, schedule=schedule, virtual_stages=v,
                                 offload=frozenset(offload))
                if unsupported(config, facts.experts > 0):
                    rejected["runtime"] = rejected.get("runtime", 0) + 1
                    continue
                bound = candidate_lower_bound(graph, facts, cluster, config, task, capacity,
                                              pins.get("recompute"))
                tie = (oi, zero, si, int(base.sequence_parallel), mesh.pp, mesh.tp, mesh.ep,
                       base.microbatch_size)
                out.append(Candidate(bound, tie, config))
    if not out and not rejected.get("runtime"):
        rejected["pinned"] = rejected.get("pinned", 0) + 1
    return out


def search(graph: Graph, facts: ModelFacts, cluster: Cluster, devices: int, task: str,
           global_batch: int, pins: dict, capacity: float, time_limit_s: float | None = None,
           progress: Progress | None = None, keep: int = 5,
           defaults: dict | None = None,
           layouts: dict[int, TPLayouts] | None = None) -> SearchResult:
    """Best plan under the cost model; raises InfeasibleError when nothing fits.

    ``pins`` fixes any of pp, dp, tp, ep, microbatch_size, num_microbatches, zero_stage,
    recompute, offload, schedule, sequence_parallel; ``defaults`` sets the remaining
    ParallelConfig fields (precision, engine, trainable fraction); ``layouts`` are the
    per-op tensor-parallel layouts per degree (:func:`autopar.search.sharding.solve_layouts`).
    """
    started = time.perf_counter()
    train = task != "infer"
    host_capacity = cluster.node.host_memory_bytes
    pinned_recompute = pins.get("recompute")
    rejected: dict[str, int] = {}
    memory_rejected: list[float] = []
    result = None
    for cross_node in (False, True):
        cands = candidates(graph, facts, cluster, devices, task, global_batch, pins, cross_node,
                           rejected, defaults or {}, layouts, capacity)
        best: tuple[ParallelConfig, Estimate] | None = None
        found: list[tuple[float, tuple, ParallelConfig, Estimate]] = []
        evaluated = pruned = 0
        leanest: tuple[float, ParallelConfig, Estimate | None] | None = None
        bound = float("inf")
        timed_out = False
        for k, cand in enumerate(cands):
            # keep going while a candidate could land within the robustness margin
            if best is not None and cand.lower_bound_s >= best[1].step_time_s * (
                    1 + ROBUST_MARGIN):
                pruned = len(cands) - k
                bound = min(cand.lower_bound_s, best[1].step_time_s)
                break
            if (time_limit_s is not None and best is not None
                    and time.perf_counter() - started > time_limit_s):
                timed_out = True
                bound = cand.lower_bound_s
                pruned = len(cands) - k
                break
            if progress and k % 64 == 0:
                progress(k / max(len(cands), 1), f"{k}/{len(cands)} candidates")
            config = cand.config
            floor = memory_lower_bound(graph, facts, cluster, config, train)
            if floor > capacity:
                rejected["memory"] = rejected.get("memory", 0) + 1
                memory_rejected.append(cand.lower_bound_s)
                if leanest is None or floor < leanest[0]:
                    leanest = (floor, config, None)
                continue
            evaluated += 1
            chosen = best_partition(graph, cluster, config, capacity, host_capacity, task,
                                    pinned_recompute)
            if chosen is None:
                rejected["memory"] = rejected.get("memory", 0) + 1
                memory_rejected.append(cand.lower_bound_s)
                lean_config = replace(config, recompute=pinned_recompute or "full",
                                      stages=None)
                lean = estimate(graph, cluster, lean_config, task)
                if leanest is None or lean.memory.total < leanest[0]:
                    leanest = (lean.memory.total, lean_config, lean)
                continue
            config, est = chosen
            found.append((est.step_time_s, cand.tie, config, est))
            if best is None or est.step_time_s < best[1].step_time_s:
                best = (config, est)
        else:
            bound = best[1].step_time_s if best is not None else float("inf")
        if best is not None:
            found.sort(key=lambda f: (f[0], f[1]))
            chosen_plan, robust = _robust_choice(graph, cluster, task, found, best)
            alternatives = _distinct_alternatives(found, chosen_plan[0], keep)
            gap = max(0.0, (best[1].step_time_s - bound) / best[1].step_time_s)
            result = SearchResult(chosen_plan[0], chosen_plan[1], alternatives,
                                  min(bound, best[1].step_time_s), gap, evaluated, pruned,
                                  rejected, time.perf_counter() - started, timed_out,
                                  memory_rejected, best, robust)
            break
        if not any(facts.tp_ok(t) for t in divisors(devices) if t > cluster.devices_per_node):
            break  # no wider tensor-parallel degree to try across nodes
    if result is None:
        raise InfeasibleError(infeasible_message(graph, facts, cluster, devices, capacity,
                                                  leanest, rejected, global_batch))
    if progress:
        progress(1.0, "done")
    return result


def _robust_choice(graph: Graph, cluster: Cluster, task: str, found: list,
                   best: tuple[ParallelConfig, Estimate]
                   ) -> tuple[tuple[ParallelConfig, Estimate], dict]:
    """Among the plans within ROBUST_MARGIN of the fastest, the one whose worse step time under
    1.5x slower communication or halved overlap is smallest (then the faster one)."""
    limit = best[1].step_time_s * (1 + ROBUST_MARGIN)
    near = [f for f in found if f[0] <= limit]
    scored = []
    for step, tie, config, est in near:
        checks = sensitivity(graph, cluster, config, task)
        scored.append((max(checks.values()), step, tie, config, est, checks))
    scored.sort(key=lambda r: (r[0], r[1], r[2]))
    worst, step, _, config, est, checks = scored[0]
    fastest_checks = next(r[5] for r in scored if r[3] is best[0])
    robust = {
        "margin": ROBUST_MARGIN, "candidates": len(near),
        "fastest_step_time_s": best[1].step_time_s,
        "fastest_worst_case_s": max(fastest_checks.values()),
        "chosen_worst_case_s": worst, "checks": checks,
        "changed": config is not best[0],
    }
    return (config, est), robust


def _distinct_alternatives(found: list, best: ParallelConfig, keep: int
                           ) -> list[tuple[ParallelConfig, Estimate]]:
    """Runner-ups that differ in mesh, ZeRO stage, schedule or offload (not just batching)."""
    seen = {_shape(best)}
    out = []
    for _, _, config, est in found:
        key = _shape(config)
        if key in seen:
            continue
        seen.add(key)
        out.append((config, est))
        if len(out) >= keep:
            break
    return out


def _shape(c: ParallelConfig) -> tuple:
    return (c.pp, c.dp, c.tp, c.ep, c.zero_stage, c.schedule, tuple(sorted(c.offload)))
