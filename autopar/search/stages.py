"""Stage partition and per-block recompute of one candidate, searched together and exactly.

A candidate (mesh, batching, ZeRO stage, schedule, offload) still needs its pipeline stages
(contiguous block ranges, the embedding and the output head counted like any block) and each
block's recompute mode. For a stage, the cheapest recompute that fits the device is exact
(``choose_recompute``): the stage's time only grows with recompute. Over partitions, a dynamic
programme runs stage by stage, keeping for every (stage, end block) the Pareto front of the
quantities the step time grows with: the slowest stage's forward + backward, their sum (the
fill and drain), the slowest stage's tail (once-per-step collectives, offload, optimizer) and
the largest send between stages. The survivors are costed in full and the fastest wins, so the
result is the best contiguous partition under the cost model. Stages whose own time already
exceeds what a known partition achieves, ``step / m``, are pruned.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, replace

from autopar.cost.block_cost import cached_block_cost
from autopar.cost.config import ParallelConfig
from autopar.cost.estimate import (
    Estimate,
    StageCost,
    balanced_stages,
    combine_stages,
    stage_cost,
    stage_footprint,
)
from autopar.cost.hardware import Cluster
from autopar.cost.memory import inflight_microbatches
from autopar.ir.graph import Graph
from autopar.plan.support import recompute_modes
from autopar.search.recompute import MODES, ModeCost, choose_recompute

# memoised stage options per graph and candidate (a pure cache of best-stage choices)
_OPTIONS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class StageOption:
    cost: StageCost
    modes: tuple[str, ...]  # recompute per block of the stage

    @property
    def time_s(self) -> float:
        return self.cost.fwd_s + self.cost.bwd_s


class StagePlanner:
    """Costs stages of one candidate, memoised by what a stage's cost depends on."""

    def __init__(self, graph: Graph, cluster: Cluster, config: ParallelConfig, capacity: float,
                 host_capacity: float, task: str, pinned: str | tuple[str, ...] | None
                 ) -> None:
        self.graph, self.cluster, self.config = graph, cluster, config
        self.capacity, self.host_capacity = capacity, host_capacity
        self.train = task != "infer"
        self.pinned = pinned if pinned is not None else (None if self.train else "none")
        self.n = len(graph.blocks)
        types = [b.type_id for b in graph.blocks]
        self.runs_end: list[int] = []  # run-length encoding of the block types
        self.run_of: list[int] = []
        for i, t in enumerate(types):
            if not self.runs_end or types[i - 1] != t:
                self.runs_end.append(i + 1)
            else:
                self.runs_end[-1] = i + 1
            self.run_of.append(len(self.runs_end) - 1)
        self.types = types
        # stage options depend on the schedule only through the micro-batches a stage keeps
        # (part of the signature), so candidates that differ in schedule alone share them
        shared = replace(config, schedule="1f1b", virtual_stages=1, stages=None,
                         recompute="none")
        # the recompute modes the runtime runs under this schedule (part of the key: the
        # options are shared across schedules)
        self.allowed = recompute_modes(config.schedule, config.engine)
        key = (shared, cluster.cache_key, capacity, host_capacity, pinned, self.train,
               self.allowed)
        per_graph = _OPTIONS.setdefault(graph, {})
        if len(per_graph) > 256:  # a long search: keep memory bounded
            per_graph.clear()
        self._memo: dict[tuple, StageOption | None] = per_graph.setdefault(key, {})
        self._blocks: dict = {}  # (type_id, recompute mode) -> BlockCost of this config

    def _signature(self, start: int, end: int, stage: int) -> tuple:
        """What a stage's cost depends on: its block types in order (run-length encoded),
        whether it holds the last block (the loss), and the micro-batches it keeps."""
        runs = []
        i = start
        while i < end:
            stop = min(self.runs_end[self.run_of[i]], end)
            runs.append((self.types[i], stop - i))
            i = stop
        c = self.config
        held = inflight_microbatches(c.schedule, c.pp, stage, c.num_microbatches,
                                     c.virtual_stages)
        return (tuple(runs), end == self.n, held, stage == c.pp - 1)

    def floor_times(self) -> list[float]:
        """Per block, the least it puts on its stage's forward + backward (no recompute, no
        data-parallel collectives): a stage's time is at least their sum."""
        out = []
        for i in range(self.n):
            key = (self.types[i], "none")
            if key not in self._blocks:
                self._blocks[key] = cached_block_cost(self.graph, i, self.config, self.cluster,
                                                      "none")
            c = self._blocks[key]
            out.append(c.fwd_s + c.tp_comm_s + (c.bwd_s + c.ep_comm_s if self.train
                                                else c.ep_comm_s / 2))
        return out

    def _footprint(self, start: int, end: int, stage: int, modes: tuple[str, ...]
                   ) -> tuple[tuple, bool]:
        """The stage's footprint (:func:`stage_footprint`) with these recompute modes, and
        whether it fits."""
        footprint = stage_footprint(self.graph, self.config, self.cluster, stage,
                                    (start, end), self.train, modes, self._blocks)
        _, mem, host, _ = footprint
        fits = (mem.total <= self.capacity
                and host * self.cluster.devices_per_node <= self.host_capacity)
        return footprint, fits

    def _option(self, start: int, end: int, stage: int, modes: tuple[str, ...],
                footprint: tuple | None = None) -> StageOption:
        cost = stage_cost(self.graph, self.config, self.cluster, stage, (start, end),
                          self.train, modes, self._blocks, footprint)
        return StageOption(cost, modes)

    def option(self, start: int, end: int, stage: int) -> StageOption | None:
        """The stage [start, end) as stage ``stage`` with its cheapest recompute that fits,
        or None when nothing fits."""
        key = self._signature(start, end, stage)
        if key not in self._memo:  # a memoised option may carry another range's ``blocks``
            self._memo[key] = self._choose(start, end, stage)
        return self._memo[key]

    def _choose(self, start: int, end: int, stage: int) -> StageOption | None:
        count = end - start
        if self.pinned is not None:
            modes = ((self.pinned,) * count if isinstance(self.pinned, str)
                     else tuple(self.pinned[start:end]))
            footprint, fits = self._footprint(start, end, stage, modes)
            return self._option(start, end, stage, modes, footprint) if fits else None
        footprint, fits = self._footprint(start, end, stage, ("none",) * count)
        if fits:
            return self._option(start, end, stage, ("none",) * count, footprint)
        plain = footprint[1]
        if not self._footprint(start, end, stage, ("full",) * count)[1]:
            return None
        c = self.config
        held = inflight_microbatches(c.schedule, c.pp, stage, c.num_microbatches,
                                     c.virtual_stages)
        if "activations" in c.offload:
            held = min(held, 1.0)
        static = plain.total - plain.activations
        by_type: dict[int, list[int]] = {}
        for i in range(start, end):
            by_type.setdefault(self.types[i], []).append(i)
        types = []
        for indices in by_type.values():
            per_mode = []
            for mode in MODES:
                b = self._blocks.get((self.types[indices[0]], mode))
                if b is None:
                    b = cached_block_cost(self.graph, indices[0], c, self.cluster, mode)
                per_mode.append(ModeCost(b.activation_bytes, b.recompute_peak_bytes,
                                         b.recompute_s))
            types.append((len(indices), per_mode))
        chosen = choose_recompute(types, static, held, self.capacity, self.allowed)
        if chosen is None:
            return self._option(start, end, stage, ("full",) * count)
        modes = ["none"] * count
        for indices, counts in zip(by_type.values(), chosen[0], strict=True):
            at = 0
            for mode in reversed(MODES):  # deterministic: earliest blocks first, least memory
                for i in indices[at:at + counts.get(mode, 0)]:
                    modes[i - start] = mode
                at += counts.get(mode, 0)
        footprint, fits = self._footprint(start, end, stage, tuple(modes))
        if fits:
            return self._option(start, end, stage, tuple(modes), footprint)
        return self._option(start, end, stage, ("full",) * count)

    def assemble(self, bounds: list[tuple[int, int]], options: list[StageOption]
                 ) -> tuple[ParallelConfig, Estimate]:
        modes: list[str] = []
        for opt in options:
            modes.extend(opt.modes)
        config = replace(self.config, stages=tuple(bounds), recompute=tuple(modes))
        costs = [replace(o.cost, blocks=b) for o, b in zip(options, bounds, strict=True)]
        est = combine_stages(self.graph, self.cluster, config, costs, self.train)
        return config, est


_TOLERANCE = 1 + 1e-9  # partitions within float noise of each other are one point


def best_partition(graph: Graph, cluster: Cluster, config: ParallelConfig, capacity: float,
                   host_capacity: float, task: str, pinned: str | tuple[str, ...] | None = None,
                   cutoff_s: float = float("inf")
                   ) -> tuple[tuple[ParallelConfig, Estimate] | None, bool]:
    """The fastest contiguous stage partition with per-stage recompute that fits (or None),
    and whether ``cutoff_s`` decided that (None because nothing fits within ``cutoff_s``).

    ``config`` must carry its precision; its ``recompute`` is replaced, and its ``stages``
    unless pinned (then only that partition is costed). With
    ``cutoff_s`` (the search passes what a plan must beat to matter), partitions slower than
    it are not searched: the result is exact when it is within ``cutoff_s``; otherwise it is
    the FLOP-balanced split when that fits (an honest, costed plan, not the candidate's best),
    else None.
    """
    planner = StagePlanner(graph, cluster, config, capacity, host_capacity, task, pinned)
    n, p, m = planner.n, config.pp, config.num_microbatches
    if p > n:
        return None, False
    if config.stages is not None:  # pinned (autopar.search.stage_pins): costed as given
        opts = [planner.option(a, b, s) for s, (a, b) in enumerate(config.stages)]
        if any(o is None for o in opts):
            return None, False
        return planner.assemble(list(config.stages), opts), False  # type: ignore[arg-type]
    if p == 1:
        opt = planner.option(0, n, 0)
        return (None if opt is None else planner.assemble([(0, n)], [opt])), False
    # the FLOP-balanced split, when it fits, is the plan to beat: a partial partition whose
    # step can no longer beat it is dropped (the step is at least m x its slowest stage plus
    # phi x the others so far plus its slowest tail)
    best: tuple[ParallelConfig, Estimate] | None = None
    # the interleaved schedule cuts every stage into virtual_stages chunks of whole blocks
    least = max(config.virtual_stages, 1) if config.schedule == "interleaved" else 1
    if p * least > n:
        return None, False
    balanced = list(balanced_stages(graph, p))
    opts = [planner.option(a, b, s) for s, (a, b) in enumerate(balanced)]
    if all(o is not None for o in opts) and all(b - a >= least for a, b in balanced):
        best = planner.assemble(balanced, opts)  # type: ignore[arg-type]
    bound = min(best[1].step_time_s if best is not None else float("inf"),
                cutoff_s) * _TOLERANCE
    cut = best is None and cutoff_s < float("inf")
    phi = {"interleaved": 1.0 / max(config.virtual_stages, 1), "zero_bubble": 0.0}.get(
        config.schedule, 1.0)
    # no stage can hold more blocks than the longest run whose blocks' own time (a floor of
    # the stage's) stays under bound / m: partial partitions that could not finish are skipped
    longest = _longest_run(planner.floor_times(), bound / m if m else float("inf"))
    # fronts[j]: partitions of blocks [0, j) into s + 1 stages, as
    # (max time, sum time, max tail, max send, (previous entry, start, option))
    fronts: list[list[tuple]] = [[] for _ in range(n + 1)]
    fronts[0] = [(0.0, 0.0, 0.0, 0.0, None)]
    for s in range(p):
        new: list[list[tuple]] = [[] for _ in range(n + 1)]
        last = s == p - 1
        for j in range(n if last else (s + 1) * least, n - (p - 1 - s) * least + 1):
            if n - j > (p - 1 - s) * longest:
                continue  # the remaining stages could not hold the remaining blocks
            front_j = new[j]
            # the stage grows as i falls
            for i in range(j - least, max(s * least, j - longest) - 1, -1):
                if not fronts[i]:
                    continue
                opt = planner.option(i, j, s)
                if opt is None or m * opt.time_s > bound:
                    break  # more blocks only cost more time and memory
                t, tail = opt.time_s, opt.cost.tail_s
                send = 0.0 if last else opt.cost.send_bytes
                for e in fronts[i]:
                    mx = e[0] if e[0] > t else t
                    sm = e[1] + t
                    tl = e[2] if e[2] > tail else tail
                    if m * mx + phi * (sm - mx) + tl > bound:
                        continue
                    _insert(front_j, (mx, sm, tl, e[3] if e[3] > send else send, (e, i, opt)))
        fronts = new
    for entry in fronts[n]:
        bounds, chain, end = [], [], n
        node = entry
        while node[4] is not None:
            prev, start, opt = node[4]
            bounds.append((start, end))
            chain.append(opt)
            end, node = start, prev
        result = planner.assemble(bounds[::-1], chain[::-1])
        if best is None or result[1].step_time_s < best[1].step_time_s * (1 - 1e-12):
            best = result
    return best, cut and best is None


def _longest_run(times: list[float], limit: float) -> int:
    """The most consecutive ``times`` any window can hold with a sum within ``limit``."""
    n = len(times)
    if limit == float("inf"):
        return n
    best = lo = 0
    total = 0.0
    for hi, t in enumerate(times):
        total += t
        while total > limit * _TOLERANCE and lo <= hi:
            total -= times[lo]
            lo += 1
        best = max(best, hi - lo + 1)
    return max(best, 1)


def _insert(front: list[tuple], cand: tuple) -> None:
    """Add ``cand`` to a Pareto front unless an entry is no worse in all four quantities
    (up to float noise); drop the entries it is no worse than."""
    a0, a1, a2, a3 = cand[0] * _TOLERANCE, cand[1] * _TOLERANCE, cand[2] * _TOLERANCE, \
        cand[3] * _TOLERANCE
    for o in front:
        if o[0] <= a0 and o[1] <= a1 and o[2] <= a2 and o[3] <= a3:
            return
    b0, b1, b2, b3 = cand[0], cand[1], cand[2], cand[3]
    front[:] = [o for o in front if not (b0 <= o[0] * _TOLERANCE and b1 <= o[1] * _TOLERANCE
                                         and b2 <= o[2] * _TOLERANCE
                                         and b3 <= o[3] * _TOLERANCE)]
    front.append(cand)
