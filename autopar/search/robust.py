"""Robust choice: how a plan's step time holds up if communication were 1.5x slower or
overlap were halved, and which of the plans within 3% of the fastest suffers least."""

from __future__ import annotations

from autopar.cost.config import ParallelConfig
from autopar.cost.estimate import Estimate, estimate
from autopar.cost.hardware import Cluster
from autopar.ir.graph import Graph

ROBUST_MARGIN = 0.03  # plans this close to the fastest compete on sensitivity
COMM_SLOWER = 1.5  # the sensitivity checks: every collective 1.5x slower ...
OVERLAP_SCALE = 0.5  # ... or half of the overlap


def sensitivity(graph: Graph, cluster: Cluster, config: ParallelConfig, task: str
                ) -> dict[str, float]:
    """Step seconds of a plan if communication were 1.5x slower and if overlap were halved."""
    slow = estimate(graph, cluster.perturbed(comm_slower=COMM_SLOWER), config, task)
    half = estimate(graph, cluster.perturbed(overlap_scale=OVERLAP_SCALE), config, task)
    return {"comm_1.5x_s": slow.step_time_s, "overlap_half_s": half.step_time_s}


def robust_choice(graph: Graph, cluster: Cluster, task: str, found: list,
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
