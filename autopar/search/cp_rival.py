"""With and without context parallelism: what the search learnt of the side it did not choose.

When the search prices both plans with cp > 1 and plans without, "why this plan" names the
best plan of the other side and what it lost on (time or memory), or why there is none: every
candidate over memory, or every one pruned by a lower bound beyond the chosen plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from autopar.cost.config import ParallelConfig
from autopar.cost.estimate import Estimate
from autopar.cost.hardware import Cluster
from autopar.ir.graph import Graph
from autopar.plan.plan import round6
from autopar.search.record import runner_up


@dataclass
class SideOutcome:
    """One side's (cp > 1, or cp = 1) candidates as the search left them."""

    candidates: int = 0
    best: tuple[ParallelConfig, Estimate] | None = None  # the fastest that fitted
    over_memory: int = 0
    # no pruned candidate of this side is faster than this (seconds)
    least_pruned_bound_s: float = float("inf")


@dataclass
class CpRival:
    """Both sides' outcomes, keyed by whether a plan uses context parallelism."""

    sides: dict[bool, SideOutcome] = field(
        default_factory=lambda: {False: SideOutcome(), True: SideOutcome()})

    @classmethod
    def of(cls, configs: list[ParallelConfig]) -> CpRival:
        """The tracker for a search over ``configs``."""
        out = cls()
        for c in configs:
            out.sides[c.cp > 1].candidates += 1
        return out

    def fitted(self, config: ParallelConfig, est: Estimate) -> None:
        side = self.sides[config.cp > 1]
        if side.best is None or est.step_time_s < side.best[1].step_time_s:
            side.best = (config, est)

    def over_memory(self, config: ParallelConfig) -> None:
        self.sides[config.cp > 1].over_memory += 1

    def pruned(self, config: ParallelConfig, bound_s: float) -> None:
        side = self.sides[config.cp > 1]
        side.least_pruned_bound_s = min(side.least_pruned_bound_s, bound_s)

    def searched_both(self) -> bool:
        """Whether the search weighed plans with and without context parallelism."""
        return all(s.candidates for s in self.sides.values())

    def rival(self, chosen: ParallelConfig) -> SideOutcome:
        """The side the chosen plan is not on."""
        return self.sides[not chosen.cp > 1]


def rival_record(graph: Graph, cluster: Cluster, config: ParallelConfig, est: Estimate,
                 rival: CpRival, task: str) -> dict:
    """For ``plan.solver["context_parallel"]``: the chosen plan's side (with or without
    context parallelism) and the other side's best plan (a runner-up entry, None when none
    fitted), its candidates over memory, and the least lower bound of those pruned."""
    side = rival.rival(config)
    bound = side.least_pruned_bound_s
    return {
        "chosen": "with" if config.cp > 1 else "without",
        "rival": "without" if config.cp > 1 else "with",
        "candidates": side.candidates, "over_memory": side.over_memory,
        "least_pruned_bound_s": round6(bound) if bound != float("inf") else None,
        "best": runner_up(graph, cluster, side.best[0], side.best[1], est, task)
        if side.best is not None else None,
    }


__all__ = ["CpRival", "SideOutcome", "rival_record"]
