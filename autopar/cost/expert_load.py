"""How unevenly a micro-batch's routed tokens load the expert-parallel ranks.

Under expert parallelism every rank waits for the busiest one: the expert GEMMs of a micro-batch
take as long as the rank that received the most token copies needs, and the combine all-to-all
as long as the busiest receiver's share. A router that its load-balancing loss keeps balanced
in expectation (or Megatron's and NeMo's forced-balance benchmark routers, which route
uniformly at random) still spreads the copies at random. With ``n`` ranks each routing
``tokens`` tokens to ``k`` experts, the ``m = n x tokens x k`` copies land on the ranks as a
multinomial, whose counts have covariance ``(m / n) (I - J / n)``: that of
``sqrt(m / n) (Z_i - mean(Z))`` for independent standard normals ``Z`` once ``m / n`` is large
(the normal limit of the multinomial). The busiest rank then expects ``m / n + sqrt(m / n) e_n``
copies, ``e_n`` the expected largest of ``n`` standard normals (the mean of ``Z`` drops out),
so it carries ``1 + e_n / sqrt(tokens x k)`` even shares. ``e_n`` is the integral of
``x n phi(x) Phi(x)^(n-1)`` (Royston 1982, "Expected normal order statistics (exact and
approximate)", Applied Statistics 31(2)): 0.564 for two ranks, 1.424 for eight, approaching
``sqrt(2 ln n)``, the balls-into-bins result for heavily loaded bins (Raab and Steger 1998,
"Balls into Bins - A Simple and Tight Analysis", RANDOM'98, Theorem 1).

This is the floor of the imbalance (every copy placed independently); a trained router whose
tokens prefer some experts is less even, which a measured run shows and this factor does not.
Routing with a capacity factor ``F`` caps each expert at ``ceil(F x seq x k / E)`` copies of
a sequence (GShard, Lepikhin et al. 2021, section 2.2; Megatron-Core's
``moe_expert_capacity_factor``), the copies past it dropped: a rank holding ``E / ep`` experts
then takes at most that many even shares, so the busiest rank's load is the smaller of the
two (:func:`capped_load`: the expectation of the smaller is at most the smaller of the
expectations, so this errs slow by the chance that the cap binds). Without a capacity factor
autopar's runtime and the models it runs route dropless, which is the default priced.
"""

from __future__ import annotations

import math
from functools import lru_cache

from autopar.ir.graph import Graph, OpNode

TOP_K_KEYS = ("num_experts_per_tok", "moe_topk", "top_k", "experts_per_token")


def top_k(graph: Graph, experts: int) -> int:
    """Experts each token is routed to, from the model's config (``experts`` when the config
    does not say: every expert, an upper bound)."""
    for key in TOP_K_KEYS:
        value = graph.model_config.get(key)
        if isinstance(value, int) and value > 0:
            return value
    return experts


def expert_count(graph: Graph, op: OpNode) -> int:
    """Experts an expert op's stacked (3-D) weights hold; 0 when it holds none."""
    for p in op.params:
        shape = graph.params[p].shape if p in graph.params else ()
        if len(shape) == 3:
            return shape[0]
    return 0


@lru_cache(maxsize=256)
def expected_max_normal(n: int) -> float:
    """The expected largest of ``n`` independent standard normals (0 for one), by integrating
    ``x n phi(x) Phi(x)^(n-1)`` over [-10, 10] with the trapezoid rule."""
    if n <= 1:
        return 0.0
    steps = 4000
    h = 20.0 / steps
    total = 0.0
    for i in range(steps + 1):
        x = -10.0 + i * h
        density = math.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)
        below = 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))
        weight = 0.5 if i in (0, steps) else 1.0
        total += weight * x * n * density * below ** (n - 1)
    return total * h


def busiest_rank_load(tokens: float, k: int, ranks: int) -> float:
    """The expected load of the busiest of ``ranks`` expert-parallel ranks, as a multiple of
    an even share, when each routes ``tokens`` tokens to ``k`` experts each, placed uniformly
    at random (see the module docstring); 1.0 without expert parallelism."""
    if ranks <= 1 or tokens <= 0 or k <= 0:
        return 1.0
    return 1.0 + expected_max_normal(ranks) / math.sqrt(tokens * k)


def capped_load(load: float, capacity_factor: float | None, seq: int, k: int,
                experts: int) -> float:
    """``load`` (even shares on the busiest rank) under a capacity factor: at most the
    capacity of a sequence, ``ceil(F x seq x k / E)`` copies per expert, in even shares."""
    if capacity_factor is None or seq <= 0 or k <= 0 or experts <= 0:
        return load
    capacity = math.ceil(capacity_factor * seq * k / experts)
    return min(load, capacity * experts / (seq * k))


__all__ = ["TOP_K_KEYS", "busiest_rank_load", "capped_load", "expected_max_normal",
           "expert_count", "top_k"]
