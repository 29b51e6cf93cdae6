"""Robust choice: how a plan's step time holds up if communication (host transfers too) were 1.5x slower or
overlap were halved, and which of the plans within 3% of the fastest suffers least; among
those, plans that leave memory headroom come first, and of those, plans that keep every state
on the device before plans that offload.

Offload is a memory remedy: its price rests on the host's optimizer rate (torch's CPU AdamW
against DeepSpeed's 5-7x faster fused one), the host's memory bandwidth (an estimate) and
what else the host runs, none of which the checks perturb. A plan that needs the host is
therefore taken only when no plan near the fastest fits with headroom without it."""

from __future__ import annotations

from autopar.cost.config import ParallelConfig
from autopar.cost.estimate import Estimate, estimate
from autopar.cost.hardware import MEMORY_RISK_FRACTION, Cluster
from autopar.ir.graph import Graph

ROBUST_MARGIN = 0.03  # plans this close to the fastest compete on sensitivity
COMM_SLOWER = 1.5  # the sensitivity checks: every collective and host transfer 1.5x slower ...
OVERLAP_SCALE = 0.5  # ... or half of the overlap


def sensitivity(graph: Graph, cluster: Cluster, config: ParallelConfig, task: str
                ) -> dict[str, float]:
    """Step seconds of a plan if communication were 1.5x slower and if overlap were halved."""
    slow = estimate(graph, cluster.perturbed(comm_slower=COMM_SLOWER), config, task)
    half = estimate(graph, cluster.perturbed(overlap_scale=OVERLAP_SCALE), config, task)
    return {"comm_1.5x_s": slow.step_time_s, "overlap_half_s": half.step_time_s}


def memory_fraction(est: Estimate, capacity_bytes: float) -> float:
    """The most loaded device's predicted bytes as a share of the usable memory."""
    return est.memory.total / capacity_bytes if capacity_bytes > 0 else 0.0


def robust_choice(graph: Graph, cluster: Cluster, task: str, found: list,
                  best: tuple[ParallelConfig, Estimate],
                  capacity_bytes: float = float("inf")
                  ) -> tuple[tuple[ParallelConfig, Estimate], dict]:
    """Among the plans within ROBUST_MARGIN of the fastest, those within MEMORY_RISK_FRACTION
    of ``capacity_bytes`` (all of them when none is), and of those the ones that offload
    nothing (all of them when every one does), the one whose worse step time under 1.5x
    slower communication or halved overlap is smallest (then the faster one)."""
    limit = best[1].step_time_s * (1 + ROBUST_MARGIN)
    near = [f for f in found if f[0] <= limit]
    lean = [f for f in near
            if memory_fraction(f[3], capacity_bytes) <= MEMORY_RISK_FRACTION]
    pool = lean or near  # nothing leaner near: the risk is taken, and the report shows it
    on_device = [f for f in pool if not f[2].offload]
    pool_before_offload = len(pool)
    pool = on_device or pool
    scored = []
    for step, tie, config, est in pool:
        checks = sensitivity(graph, cluster, config, task)
        scored.append((max(checks.values()), step, tie, config, est, checks))
    scored.sort(key=lambda r: (r[0], r[1], r[2]))
    worst, step, _, config, est, checks = scored[0]
    fastest_checks = next((r[5] for r in scored if r[3] is best[0]), None)
    if fastest_checks is None:  # the fastest was passed over for its memory
        fastest_checks = sensitivity(graph, cluster, best[0], task)
    share = memory_fraction(est, capacity_bytes)
    robust = {
        "margin": ROBUST_MARGIN, "candidates": len(near),
        "fastest_step_time_s": best[1].step_time_s,
        "fastest_worst_case_s": max(fastest_checks.values()),
        "chosen_worst_case_s": worst, "checks": checks,
        "changed": config is not best[0],
        "memory_risk_fraction": MEMORY_RISK_FRACTION,
        "memory_fraction": share, "memory_risk": share > MEMORY_RISK_FRACTION,
        "fastest_memory_fraction": memory_fraction(best[1], capacity_bytes),
        "passed_over_for_memory": len(near) - pool_before_offload,
        "passed_over_for_offload": pool_before_offload - len(pool),
    }
    return (config, est), robust
