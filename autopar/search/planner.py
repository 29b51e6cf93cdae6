"""Exhaustive search with lower-bound pruning over the plan space, exact under the cost model.

Candidates (mesh x micro-batch x sequence parallel x ZeRO stage x schedule x offload) are
ordered by a lower bound on their step time: the compute and tensor/expert-parallel
communication of one step, with no recompute, spread perfectly over the pipeline stages. They
are evaluated in that order (stage partition, then the cheapest per-block recompute that fits
memory, then the full cost model) until the next lower bound is no better than the best plan
found: everything after it is provably no better. The bound and gap are reported; with
``time_limit_s`` the search stops early and reports the gap it proved.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from autopar.cost.config import ParallelConfig
from autopar.cost.estimate import Estimate, balanced_stages, cached_block_cost, estimate
from autopar.cost.hardware import Cluster
from autopar.cost.memory import inflight_microbatches
from autopar.errors import InfeasibleError
from autopar.ir.graph import Graph
from autopar.search.infeasible import infeasible_message
from autopar.search.recompute import MODES, ModeCost, choose_recompute
from autopar.search.space import (
    OFFLOAD_CHOICES,
    SCHEDULES_PP,
    Mesh,
    ModelFacts,
    divisors,
    legal_meshes,
)
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


def _lower_bound(graph: Graph, cluster: Cluster, config: ParallelConfig, train: bool,
                 schedule: str = "1f1b", virtual_stages: int = 1) -> float:
    """No step can be faster: the work of one micro-batch, W, split evenly over p stages, run
    m times, plus the schedule's fill and drain on the even split, (p - 1) W / p x phi
    (phi = 1, 1/v interleaved, (W - 2 w) / W zero-bubble with w the weight-gradient time). With stage times t_i summing to W the
    step is at least m max(t) + (W - max(t)) phi, smallest at max(t) = W / p."""
    weight_grad = total = 0.0
    for i in range(len(graph.blocks)):
        c = cached_block_cost(graph, i, config, cluster, "none")
        weight_grad += c.bwd_s / 2 if train else 0.0
        total += c.fwd_s + c.tp_comm_s + c.ep_comm_s + (c.bwd_s if train else 0.0)
    p, m = config.pp, config.num_microbatches
    phi = 1.0
    if schedule == "interleaved":
        phi = 1 / virtual_stages
    elif schedule == "zero_bubble":
        phi = (total - 2 * weight_grad) / total if total else 1.0
    return total / p * (m + (p - 1) * phi)


def _states_floor(graph: Graph, facts: ModelFacts, config: ParallelConfig, train: bool
                  ) -> tuple[float, float, float]:
    """(parameter, gradient, optimizer) bytes that some device holds at least: the model states
    split as evenly as the mesh allows, before offload."""
    dense = (graph.num_params - facts.expert_params) / (config.tp * config.pp)
    experts = facts.expert_params / (config.ep * config.pp)
    out = [0.0, 0.0, 0.0]
    for numel, replicas in ((dense, config.dp * config.ep), (experts, config.dp)):
        p, g = float(config.param_bytes), float(config.grad_bytes)
        o = float(config.optimizer_bytes) * config.trainable_fraction
        if not train:
            g = o = 0.0
        if config.zero_stage >= 1:
            o /= replicas
        if config.zero_stage >= 2:
            g /= replicas
        if config.zero_stage >= 3:
            p /= replicas
        out[0] += numel * p
        out[1] += numel * g * config.trainable_fraction
        out[2] += numel * o
    return out[0], out[1], out[2]


def _memory_lower_bound(graph: Graph, facts: ModelFacts, cluster: Cluster,
                        config: ParallelConfig, train: bool) -> float:
    """No device of this candidate needs less: the states floor (less what is offloaded) plus a
    1/pp share of the activations every block keeps even under full recompute."""
    params, grads, optimizer = _states_floor(graph, facts, config, train)
    if "optimizer" in config.offload:
        optimizer = 0.0
    if "params" in config.offload:
        params = 0.0
    total = params + grads + optimizer
    if train:
        lean = sum(cached_block_cost(graph, i, config, cluster, "full").activation_bytes
                   for i in range(len(graph.blocks)))
        total += lean / config.pp
    return total


def _update_time_lower_bound(graph: Graph, facts: ModelFacts, cluster: Cluster,
                             config: ParallelConfig, train: bool) -> float:
    """The optimizer update and the optimizer/parameter offload streams, from the states floor
    (the same formulas as the cost model, on the least any device holds)."""
    if not train:
        return 0.0
    params, grads, optimizer = _states_floor(graph, facts, config, train)
    device = cluster.device
    on_device = params + grads + (0.0 if "optimizer" in config.offload else optimizer)
    seconds = 2 * on_device / (device.memory_bandwidth * device.efficiency.memory)
    if "optimizer" in config.offload:
        local = optimizer / max(config.optimizer_bytes, 1)
        seconds += local * (config.grad_bytes + config.param_bytes) / cluster.node.host_bandwidth
    if "params" in config.offload:
        hidden = 0.5 * device.efficiency.overlap
        seconds += params * 2 * config.num_microbatches / cluster.node.host_bandwidth * (1 - hidden)
    return seconds


def candidates(graph: Graph, facts: ModelFacts, cluster: Cluster, devices: int, task: str,
               global_batch: int, pins: dict, allow_cross_node_tp: bool,
               rejected: dict[str, int], defaults: dict) -> list[Candidate]:
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
                                      num_microbatches=m, **defaults)
                out.extend(_knob_variants(graph, cluster, base, mesh, facts, task, pins,
                                          rejected))
    out.sort()
    return out


def _knob_variants(graph: Graph, cluster: Cluster, base: ParallelConfig, mesh: Mesh,
                   facts: ModelFacts, task: str, pins: dict, rejected: dict[str, int]
                   ) -> list[Candidate]:
    train = task != "infer"
    replicas = mesh.dp * mesh.ep
    zeros = (0, 1, 2, 3) if train and replicas > 1 else (0,)
    if mesh.pp == 1:
        schedules = [("1f1b", 1)]
    else:
        schedules = []
        for name in SCHEDULES_PP:
            if name == "interleaved":
                if base.num_microbatches % mesh.pp or facts.blocks < 2 * mesh.pp:
                    continue
                schedules.append((name, 2))
            else:
                schedules.append((name, 1))
    offloads = OFFLOAD_CHOICES if train else ((), ("params",))
    out = []
    for zero in zeros:
        if pins.get("zero_stage", zero) != zero:
            continue
        for si, (schedule, v) in enumerate(schedules):
            if pins.get("schedule", schedule) != schedule and mesh.pp > 1:
                continue
            lb = _lower_bound(graph, cluster, base, train, schedule, v)
            for oi, offload in enumerate(offloads):
                if "offload" in pins and tuple(sorted(pins["offload"])) != offload:
                    continue
                config = replace(base, zero_stage=zero, schedule=schedule, virtual_stages=v,
                                 offload=frozenset(offload))
                if unsupported(config, facts.experts > 0):
                    rejected["runtime"] = rejected.get("runtime", 0) + 1
                    continue
                bound = lb + _update_time_lower_bound(graph, facts, cluster, config, train)
                tie = (oi, zero, si, int(base.sequence_parallel), mesh.pp, mesh.tp, mesh.ep,
                       base.microbatch_size)
                out.append(Candidate(bound, tie, config))
    if not out and not rejected.get("runtime"):
        rejected["pinned"] = rejected.get("pinned", 0) + 1
    return out


def fit_recompute(graph: Graph, cluster: Cluster, config: ParallelConfig, capacity: float,
                  host_capacity: float, task: str, pinned: str | None
                  ) -> tuple[ParallelConfig, Estimate | None, Estimate]:
    """The cheapest per-block recompute that fits ``capacity``.

    Returns (the config with its recompute, its estimate or None when nothing fits, the
    leanest estimate). Full recompute is tried first: it stores the least, so when it does not
    fit nothing does.
    """
    train = task != "infer"
    if pinned is not None or not train:
        config = replace(config, recompute=pinned or "none")
        est = estimate(graph, cluster, config, task)
        return config, (est if est.fits(capacity, host_capacity) else None), est
    lean_config = replace(config, recompute="full")
    lean = estimate(graph, cluster, lean_config, task)
    if not lean.fits(capacity, host_capacity):
        return lean_config, None, lean
    none_config = replace(config, recompute="none")
    est = estimate(graph, cluster, none_config, task)
    if est.fits(capacity, host_capacity):
        return none_config, est, lean
    modes: list[str] = ["none"] * len(graph.blocks)
    for s, stage in enumerate(est.stages):
        start, end = stage.blocks
        static = stage.memory.total - stage.memory.activations
        held = inflight_microbatches(config.schedule, config.pp, s, config.num_microbatches,
                                     config.virtual_stages)
        if "activations" in config.offload:
            held = min(held, 1.0)
        by_type: dict[int, list[int]] = {}
        for i in range(start, end):
            by_type.setdefault(graph.blocks[i].type_id, []).append(i)
        types = []
        for indices in by_type.values():
            costs = []
            for mode in MODES:
                c = cached_block_cost(graph, indices[0], config, cluster, mode)
                costs.append(ModeCost(c.activation_bytes, c.recompute_peak_bytes, c.recompute_s))
            types.append((len(indices), costs))
        chosen = choose_recompute(types, static, held, capacity)
        if chosen is None:
            return lean_config, lean, lean  # all-full fits, so this cannot happen
        for indices, counts in zip(by_type.values(), chosen[0], strict=True):
            at = 0
            for mode in ("full", "selective", "none"):  # deterministic: earliest blocks first
                for i in indices[at:at + counts.get(mode, 0)]:
                    modes[i] = mode
                at += counts.get(mode, 0)
    chosen_config = replace(config, recompute=tuple(modes))
    est = estimate(graph, cluster, chosen_config, task)
    if est.fits(capacity, host_capacity):
        return chosen_config, est, lean
    return lean_config, lean, lean


def search(graph: Graph, facts: ModelFacts, cluster: Cluster, devices: int, task: str,
           global_batch: int, pins: dict, capacity: float, time_limit_s: float | None = None,
           progress: Progress | None = None, keep: int = 5,
           defaults: dict | None = None) -> SearchResult:
    """Best plan under the cost model; raises InfeasibleError when nothing fits.

    ``pins`` fixes any of pp, dp, tp, ep, microbatch_size, num_microbatches, zero_stage,
    recompute, offload, schedule, sequence_parallel; ``defaults`` sets the remaining
    ParallelConfig fields (compute dtype, bytes per state, trainable fraction).
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
                           rejected, defaults or {})
        stages_of: dict[int, tuple[tuple[int, int], ...]] = {}
        best: tuple[ParallelConfig, Estimate] | None = None
        found: list[tuple[float, tuple, ParallelConfig, Estimate]] = []
        evaluated = pruned = 0
        leanest: tuple[float, ParallelConfig, Estimate | None] | None = None
        bound = float("inf")
        timed_out = False
        for k, cand in enumerate(cands):
            if best is not None and cand.lower_bound_s >= best[1].step_time_s:
                pruned = len(cands) - k
                bound = best[1].step_time_s
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
            floor = _memory_lower_bound(graph, facts, cluster, config, train)
            if floor > capacity:
                rejected["memory"] = rejected.get("memory", 0) + 1
                memory_rejected.append(cand.lower_bound_s)
                if leanest is None or floor < leanest[0]:
                    leanest = (floor, config, None)
                continue
            if config.pp not in stages_of:
                stages_of[config.pp] = balanced_stages(graph, config.pp)
            config = replace(config, stages=stages_of[config.pp])
            evaluated += 1
            config, est, lean = fit_recompute(graph, cluster, config, capacity, host_capacity,
                                              task, pinned_recompute)
            if est is None:
                rejected["memory"] = rejected.get("memory", 0) + 1
                memory_rejected.append(cand.lower_bound_s)
                if leanest is None or lean.memory.total < leanest[0]:
                    leanest = (lean.memory.total, config, lean)
                continue
            found.append((est.step_time_s, cand.tie, config, est))
            if best is None or est.step_time_s < best[1].step_time_s:
                best = (found[-1][2], est)
        else:
            bound = best[1].step_time_s if best is not None else float("inf")
        if best is not None:
            found.sort(key=lambda f: (f[0], f[1]))
            alternatives = _distinct_alternatives(found, best[0], keep)
            gap = max(0.0, (best[1].step_time_s - bound) / best[1].step_time_s)
            result = SearchResult(best[0], best[1], alternatives, min(bound, best[1].step_time_s),
                                  gap, evaluated, pruned, rejected,
                                  time.perf_counter() - started, timed_out, memory_rejected)
            break
        if not any(facts.tp_ok(t) for t in divisors(devices) if t > cluster.devices_per_node):
            break  # no wider tensor-parallel degree to try across nodes
    if result is None:
        raise InfeasibleError(infeasible_message(graph, facts, cluster, devices, capacity,
                                                  leanest, rejected, global_batch))
    if progress:
        progress(1.0, "done")
    return result


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
