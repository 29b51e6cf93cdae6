"""Exhaustive search with lower-bound pruning over the plan space, exact under the cost model.

Candidates (mesh x micro-batch x sequence parallel x ZeRO stage x schedule x offload) are
ordered by a lower bound on their step time: the compute and tensor/expert-parallel
communication of one step, with no recompute, spread perfectly over the pipeline stages, plus
the optimizer update and offload streams of the least any device holds. They are evaluated in
that order (the best contiguous stage partition with the cheapest per-block recompute that fits
memory, then the full cost model) until the next lower bound is beyond the best plan found by
more than the robustness margin: everything after it is provably no better. The bound and gap
are reported; with ``time_limit_s`` the search stops early and reports the gap it proved.

Robust choice: among the plans within ``ROBUST_MARGIN`` (3%) of the fastest, those that use at
most ``MEMORY_RISK_FRACTION`` (95%) of the usable memory (all of them when none does), the
planner picks the one whose step time suffers least if communication were 1.5x slower or
overlap halved (its worst of the two), and records both the fastest and the choice.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from autopar.cost.config import ParallelConfig, TPLayouts
from autopar.cost.engines import MEGATRON_ENGINES, megatron_chunks_divide
from autopar.cost.estimate import Estimate, estimate
from autopar.cost.hardware import Cluster
from autopar.errors import InfeasibleError
from autopar.ir.graph import Graph
from autopar.plan.support import unsupported
from autopar.search.best_first import BestFirst, CandidateGroup
from autopar.search.bounds import (
    candidate_lower_bound,
    host_lower_bound,
    memory_lower_bound,
    pipelined_work_lower_bound,
)
from autopar.search.cp_rival import CpRival
from autopar.search.infeasible import infeasible_message
from autopar.search.robust import MEMORY_RISK_FRACTION, ROBUST_MARGIN, robust_choice
from autopar.search.space import (
    OFFLOAD_CHOICES,
    SCHEDULES_PP,
    Mesh,
    ModelFacts,
    divisors,
    legal_meshes,
    offload_choices,
)
from autopar.search.spec import SearchOptions, SearchProblem
from autopar.search.stage_pins import pinned_stages
from autopar.search.stages import best_partition


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
    # the plans with and without context parallelism, where the search weighed both
    cp_rival: CpRival | None = None


VIRTUAL_STAGES = (2, 3, 4, 6, 8)  # model chunks per device the interleaved schedule tries


def candidate_groups(graph: Graph, facts: ModelFacts, cluster: Cluster, devices: int,
                     task: str, global_batch: int, pins: dict, allow_cross_node_tp: bool,
                     defaults: dict, layouts: dict[int, TPLayouts] | None = None,
                     staged_layouts: dict[int, TPLayouts] | None = None
                     ) -> list[CandidateGroup]:
    """One group per mesh (with its cp mode) x micro-batch x sequence parallelism, bounded by
    :func:`pipelined_work_lower_bound`; :func:`_knob_variants` expands one into candidates."""
    out: list[CandidateGroup] = []
    train = task != "infer"
    meshes = legal_meshes(facts, devices, global_batch, cluster.devices_per_node, pins,
                          allow_cross_node_tp, engine=defaults.get("engine", "autopar"))
    for mesh in meshes:
        stages = pinned_stages(graph, mesh.pp, pins, defaults.get("engine", "autopar"))
        replica_batch = global_batch // (mesh.dp * mesh.ep)
        for mb in divisors(replica_batch):
            m = replica_batch // mb
            if pins.get("microbatch_size", mb) != mb or pins.get("num_microbatches", m) != m:
                continue
            chosen = staged_layouts if mesh.pp > 1 and staged_layouts is not None else layouts
            tp_layouts = (chosen or {}).get(mesh.tp)
            sp_ok = sequence_parallel_possible(graph, facts, tp_layouts, mesh.tp)
            if (not sp_ok and pins.get("sequence_parallel")
                    and sequence_parallel_possible(graph, facts, None, mesh.tp)):
                # the solver split nothing at this degree, but sequence parallelism was asked
                # for: Megatron's split, which it shards between
                tp_layouts, sp_ok = None, True
            for sp in ((False, True) if sp_ok else (False,)):
                if pins.get("sequence_parallel", sp) != sp:
                    continue
                base = ParallelConfig(dp=mesh.dp, tp=mesh.tp, pp=mesh.pp, ep=mesh.ep,
                                      cp=mesh.cp, cp_mode=mesh.cp_mode,
                                      sequence_parallel=sp, microbatch_size=mb,
                                      num_microbatches=m, stages=stages,
                                      tp_layouts=tp_layouts, **defaults)
                out.append(CandidateGroup(
                    pipelined_work_lower_bound(graph, cluster, base, train),
                    (mesh.cp, int(sp), mesh.pp, mesh.tp, mesh.ep, mb, mesh.cp_mode),
                    base, mesh))
    return out


def _knob_variants(graph: Graph, cluster: Cluster, base: ParallelConfig, mesh: Mesh,
                   facts: ModelFacts, task: str, pins: dict, rejected: dict[str, int],
                   capacity: float, reasons: set[str]) -> list[Candidate]:
    train = task != "infer"
    replicas = mesh.dp * mesh.ep * mesh.cp  # cp ranks hold the same parameters too
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
                # a pinned count is tried whatever it is (Megatron's one layer per chunk:
                # pp8 x v12 over 96 layers)
                for v in ((pins["virtual_stages"],) if "virtual_stages" in pins
                          else VIRTUAL_STAGES):
                    # Megatron-LM states virtual stages as layers per chunk: they must divide
                    if base.engine in MEGATRON_ENGINES and not megatron_chunks_divide(
                            base.engine, facts.layers, v * mesh.pp):
                        continue
                    if v * mesh.pp <= facts.blocks and pins.get("virtual_stages", v) == v:
                        schedules.append((name, v))
            elif pins.get("virtual_stages", 1) == 1:
                schedules.append((name, 1))
    # a pinned offload is tried even on a CPU device (to test the runtime's offload there)
    offloads = OFFLOAD_CHOICES if "offload" in pins else offload_choices(cluster.device.type,
                                                                          train)
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
                pinned = pins.get("recompute")
                checked = config if pinned is None else replace(
                    config, recompute=pinned if isinstance(pinned, str) else tuple(pinned))
                reason = unsupported(checked)
                if reason is not None:
                    rejected["runtime"] = rejected.get("runtime", 0) + 1
                    reasons.add(reason)
                    continue
                bound = candidate_lower_bound(graph, facts, cluster, config, task, capacity,
                                              pins.get("recompute"))
                # equal bounds: no context parallelism before some (it only adds exchanges)
                tie = (oi, zero, si, int(base.sequence_parallel), mesh.cp, mesh.pp, mesh.tp,
                       mesh.ep, base.microbatch_size, mesh.cp_mode)
                out.append(Candidate(bound, tie, config))
    if not out and not rejected.get("runtime"):
        rejected["pinned"] = rejected.get("pinned", 0) + 1
    return out


def sequence_parallel_possible(graph: Graph, facts: ModelFacts,
                               tp_layouts: TPLayouts | None, tp: int) -> bool:
    """Whether sequence parallelism is a choice at degree ``tp``: the layers carry a
    sequence, and some layer splits a projection (sequence parallelism shards the stream
    between split regions; with nothing split it only adds collectives)."""
    if tp == 1 or not facts.sequence_stream:
        return False
    if tp_layouts is None:
        return True
    for type_id in {b.type_id for b in graph.layer_blocks or graph.blocks}:
        layout = tp_layouts.get(type_id)
        if layout is None or layout.column or layout.row or layout.kv:
            return True
    return False


def search(problem: SearchProblem, options: SearchOptions | None = None) -> SearchResult:
    """Best plan for ``problem`` under the cost model (searched as ``options`` say: default
    no time limit, five runner-ups); raises InfeasibleError when nothing fits."""
    options = options or SearchOptions()
    graph, facts, cluster, devices = problem.graph, problem.facts, problem.cluster, \
        problem.devices
    task, global_batch, pins, capacity = problem.task, problem.global_batch, problem.pins, \
        problem.capacity
    defaults, layouts = problem.defaults, problem.layouts
    time_limit_s, progress, keep = options.time_limit_s, options.progress, options.keep
    started = time.perf_counter()
    train = task != "infer"
    host_capacity = cluster.node.host_memory_bytes
    pinned_recompute = pins.get("recompute")
    rejected: dict[str, int] = {}
    memory_rejected: list[float] = []
    reasons: set[str] = set()
    result = None
    for cross_node in (False, True):
        groups = candidate_groups(graph, facts, cluster, devices, task, global_batch, pins,
                                  cross_node, defaults or {}, layouts,
                                  problem.staged_layouts)
        # candidates in lower-bound order; a group is priced only when its bound is reached
        cands = BestFirst(groups, lambda g: _knob_variants(
            graph, cluster, g.base, g.payload, facts, task, pins, rejected, capacity, reasons))
        best: tuple[ParallelConfig, Estimate] | None = None
        found: list[tuple[float, tuple, ParallelConfig, Estimate]] = []
        evaluated = pruned = 0
        leanest: tuple[float, ParallelConfig, Estimate | None] | None = None
        # the offloading candidate whose node keeps least on the host, when hosts ruled out
        host_leanest: tuple[float, ParallelConfig] | None = None
        bound = float("inf")
        timed_out = False
        rival = CpRival.of([g.base for g in groups])
        for k, cand in enumerate(cands):
            # keep going while a candidate could land within the robustness margin
            if best is not None and cand.lower_bound_s >= best[1].step_time_s * (
                    1 + ROBUST_MARGIN):
                bound = min(cand.lower_bound_s, best[1].step_time_s)
                pruned += _prune_rest(cand, cands, rival)
                break
            if (time_limit_s is not None and best is not None
                    and time.perf_counter() - started > time_limit_s):
                timed_out = True
                bound = cand.lower_bound_s
                pruned += _prune_rest(cand, cands, rival)
                break
            if progress and k % 64 == 0:
                progress(cands.progress(), f"{k} candidates, {len(groups)} meshes")
            config = cand.config
            floor = memory_lower_bound(graph, facts, cluster, config, train)
            # the host floor matters only for a candidate the device could hold
            host_floor = 0.0 if floor > capacity else host_lower_bound(graph, facts, cluster,
                                                                        config, train)
            if floor > capacity or host_floor > host_capacity:
                kind = "memory" if floor > capacity else "host memory"
                rejected[kind] = rejected.get(kind, 0) + 1
                rival.over_memory(config)
                memory_rejected.append(cand.lower_bound_s)
                if floor > capacity:
                    if leanest is None or floor < leanest[0]:
                        leanest = (floor, config, None)
                elif host_leanest is None or host_floor < host_leanest[0]:
                    host_leanest = (host_floor, config)
                continue
            evaluated += 1
            # only plans within the robustness margin of the best so far can matter
            cutoff = (best[1].step_time_s * (1 + ROBUST_MARGIN) if best is not None
                      else float("inf"))
            chosen, beyond_cutoff = best_partition(graph, cluster, config, capacity,
                                                   host_capacity, task, pinned_recompute, cutoff)
            if beyond_cutoff:  # nothing within the margin of the best: no better, pruned
                pruned += 1
                rival.pruned(config, max(cand.lower_bound_s, cutoff))
                continue
            if chosen is None:
                rejected["memory"] = rejected.get("memory", 0) + 1
                rival.over_memory(config)
                memory_rejected.append(cand.lower_bound_s)
                lean_config = replace(config, recompute=pinned_recompute or "full",
                                      stages=None)
                lean = estimate(graph, cluster, lean_config, task)
                if lean.memory.total <= capacity < float("inf") and \
                        lean.host_bytes_per_node > host_capacity:
                    # the device holds it, the node's host does not
                    if host_leanest is None or lean.host_bytes_per_node < host_leanest[0]:
                        host_leanest = (lean.host_bytes_per_node, lean_config)
                elif leanest is None or lean.memory.total < leanest[0]:
                    leanest = (lean.memory.total, lean_config, lean)
                continue
            config, est = chosen
            found.append((est.step_time_s, cand.tie, config, est))
            rival.fitted(config, est)
            if best is None or est.step_time_s < best[1].step_time_s:
                best = (config, est)
            # the fastest partition fills memory to the brim; the same mesh with a little more
            # recompute (or another split) that keeps the allocator's margin competes too, so
            # a risky plan is chosen only when no lean one is near (robust.py)
            lean_cutoff = best[1].step_time_s * (1 + ROBUST_MARGIN)
            # a leaner split of the same mesh is no faster: worth pricing only when this one
            # is itself within the margin
            if est.memory.total > MEMORY_RISK_FRACTION * capacity and \
                    est.step_time_s <= lean_cutoff:
                lean, _ = best_partition(graph, cluster, replace(config, stages=cand.config.stages),
                                         MEMORY_RISK_FRACTION * capacity, host_capacity, task,
                                         pinned_recompute, lean_cutoff)
                if lean is not None and lean[1].step_time_s <= lean_cutoff:
                    found.append((lean[1].step_time_s, cand.tie, lean[0], lean[1]))
        else:
            bound = best[1].step_time_s if best is not None else float("inf")
        if best is not None:
            found.sort(key=lambda f: (f[0], f[1]))
            chosen_plan, robust = robust_choice(graph, cluster, task, found, best,
                                                capacity)
            alternatives = _distinct_alternatives(found, chosen_plan[0], keep)
            gap = max(0.0, (best[1].step_time_s - bound) / best[1].step_time_s)
            result = SearchResult(chosen_plan[0], chosen_plan[1], alternatives,
                                  min(bound, best[1].step_time_s), gap, evaluated, pruned,
                                  rejected, time.perf_counter() - started, timed_out,
                                  memory_rejected, best, robust,
                                  rival if rival.searched_both() else None)
            break
        if not any(facts.tp_ok(t) for t in divisors(devices) if t > cluster.devices_per_node):
            break  # no wider tensor-parallel degree to try across nodes
    if result is None:
        raise InfeasibleError(infeasible_message(graph, facts, cluster, devices, capacity,
                                                  leanest, rejected, global_batch, reasons,
                                                  host_leanest, host_capacity))
    if progress:
        progress(1.0, "done")
    return result


def _prune_rest(cand: Candidate, cands: BestFirst, rival: CpRival) -> int:
    """Count ``cand`` and everything ``cands`` has not yielded as pruned (a group never
    expanded counts once), telling ``rival`` their bounds."""
    rest = [(cand.config, cand.lower_bound_s), *cands.rest()]
    for config, bound_s in rest:
        rival.pruned(config, bound_s)
    return len(rest)


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
    return (c.pp, c.dp, c.cp, c.cp_mode, c.tp, c.ep, c.zero_stage, c.schedule,
            tuple(sorted(c.offload)))
