"""The registered parallelisms (:mod:`autopar.plan.parallelisms`) chosen on the plan the search
found: each value priced against the step and memory the estimate gave, the fastest that fits
kept (the first value, what a plan without it runs, on a tie), a pinned value taken as given.
The plan records the values that differ from the first, and its predictions carry their
price."""

from __future__ import annotations

from autopar.cost.config import ParallelConfig
from autopar.cost.hardware import Cluster
from autopar.errors import PlanError
from autopar.ir.graph import Graph
from autopar.plan.parallelisms import Parallelism, all_registered, registered
from autopar.plan.plan import Plan, round6


def registered_pins(pins: dict) -> dict:
    """Take the registered parallelisms' pins out of ``pins`` (the search does not know them)
    and return them."""
    return {k: pins.pop(k) for k in list(pins) if registered(k) is not None}


def choose_parallelisms(plan: Plan, graph: Graph, cluster: Cluster, config: ParallelConfig,
                        pinned: dict, capacity: float) -> None:
    """Set ``plan.parallelisms`` and add their price to ``plan.predicted`` (``config``: the
    configuration the plan was built from; ``capacity``: the bytes a device may hold)."""
    if plan.task == "infer":
        if any(v != registered(k).values[0] for k, v in pinned.items()):
            raise PlanError(f"{', '.join(pinned)}: registered parallelisms apply to training "
                            f"plans; drop the pin to plan serving")
        return
    for p in all_registered():
        reason = p.supported(config)
        if reason is not None:
            if p.name in pinned and pinned[p.name] != p.values[0]:
                raise PlanError(f"{p.name}={pinned[p.name]!r} does not apply to this plan "
                                f"({reason}); drop the pin, or pin a plan it applies to")
            continue
        value, (seconds, nbytes) = _best_value(p, plan, graph, cluster, config, pinned,
                                               capacity)
        if value != p.values[0]:
            plan.parallelisms[p.name] = value
            _add_price(plan, p, seconds, nbytes)


def _best_value(p: Parallelism, plan: Plan, graph: Graph, cluster: Cluster,
                config: ParallelConfig, pinned: dict, capacity: float) -> tuple:
    """(value, (seconds, bytes) it adds to the plan), relative to the first value's price."""
    base_s, base_b = p.price(graph, config, cluster, p.values[0])
    step, memory = plan.predicted.step_time_s, plan.predicted.memory["total"]
    best, best_step = (p.values[0], (0.0, 0.0)), step
    for value in ([pinned[p.name]] if p.name in pinned else p.values[1:]):
        seconds, nbytes = p.price(graph, config, cluster, value)
        delta = (seconds - base_s, nbytes - base_b)
        fits = memory + delta[1] <= capacity
        if p.name in pinned:
            if not fits:
                raise PlanError(f"{p.name}={value!r} needs {delta[1] / 1e9:.3g} GB more than "
                                f"fits on a device; drop the pin")
            return value, delta
        if fits and step + delta[0] < best_step:
            best, best_step = (value, delta), step + delta[0]
    return best


def _add_price(plan: Plan, p: Parallelism, seconds: float, nbytes: float) -> None:
    pred = plan.predicted
    before = pred.step_time_s
    pred.step_time_s = round6(before + seconds)
    pred.breakdown[p.term] = round6(pred.breakdown.get(p.term, 0.0) + seconds)
    pred.memory[p.memory_kind] = round6(pred.memory.get(p.memory_kind, 0.0) + nbytes)
    pred.memory["total"] = round6(pred.memory["total"] + nbytes)
    if pred.step_time_s > 0:  # the same work in a different time
        pred.mfu = round6(pred.mfu * before / pred.step_time_s)
        pred.tokens_per_s = round6(pred.tokens_per_s * before / pred.step_time_s)
