"""Two plans side by side: what changed in the decision, and its predicted effect."""

from __future__ import annotations

import json

from autopar.plan import Plan
from autopar.report import fmt
from autopar.report.fmt import MEMORY_KINDS, MEMORY_LABELS, TIME_LABELS, TIME_TERMS
from autopar.report.text import md_table, text_table

_FIELDS = ("devices", "cluster", "task", "global_batch", "microbatch_size", "num_microbatches",
           "zero_stage", "schedule", "virtual_stages", "sequence_parallel")


def _modes(plan: Plan) -> str:
    return fmt.recompute_counts(plan.recompute_counts())


def _pinned(plan: Plan) -> str:
    pins = plan.solver.get("bounds", {}).get("constraints", {}).get("pinned") or {}
    return ", ".join(f"{k}={v}" for k, v in pins.items()) or "none"


def plan_diff(a: Plan, b: Plan) -> dict:
    """The decision fields that differ and every predicted number, A against B."""
    changes = []

    def add(name: str, va: object, vb: object) -> None:
        if va != vb:
            changes.append({"field": name, "a": va, "b": vb})

    add("model", a.model.get("model_type") or a.model.get("source"),
        b.model.get("model_type") or b.model.get("source"))
    add("params", a.model.get("params"), b.model.get("params"))
    for axis in ("pp", "dp", "tp", "ep"):
        add(axis, a.mesh[axis], b.mesh[axis])
    for name in _FIELDS:
        add(name, getattr(a, name), getattr(b, name))
    add("recompute", _modes(a), _modes(b))
    add("offload", fmt.offload(a.offload), fmt.offload(b.offload))
    add("parallelisms", a.parallelisms or "none", b.parallelisms or "none")
    add("stages", a.stages, b.stages)
    add("memory limit", a.memory_limit_bytes, b.memory_limit_bytes)
    add("constraints", _pinned(a), _pinned(b))
    pa, pb = a.placements.get("params", {}), b.placements.get("params", {})
    moved = sorted(k for k in set(pa) | set(pb) if pa.get(k) != pb.get(k))
    placements = {"changed": len(moved), "examples": [
        {"param": k, "a": pa.get(k, "-"), "b": pb.get(k, "-")} for k in moved[:5]]}
    blocks_changed = [i for i, (x, y) in enumerate(zip(a.recompute, b.recompute, strict=False))
                      if x != y]

    def metric(name: str, va: float, vb: float) -> dict:
        return {"metric": name, "a": va, "b": vb, "delta": vb - va,
                "relative": (vb - va) / va if va else None}

    ma, mb = a.predicted.memory, b.predicted.memory
    effect = [metric("step_time_s", a.predicted.step_time_s, b.predicted.step_time_s),
              metric("tokens_per_s", a.predicted.tokens_per_s, b.predicted.tokens_per_s),
              metric("mfu", a.predicted.mfu, b.predicted.mfu),
              metric("bubble_s", a.predicted.bubble_s, b.predicted.bubble_s)]
    effect += [metric(f"memory.{k}", ma.get(k, 0.0), mb.get(k, 0.0))
               for k in (*MEMORY_KINDS, "total")]
    ba, bb = a.predicted.breakdown, b.predicted.breakdown
    breakdown = [metric(t, ba.get(t, 0.0), bb.get(t, 0.0)) for t in TIME_TERMS
                 if ba.get(t) or bb.get(t)] if ba and bb else []
    return {"changes": changes, "placements": placements,
            "recompute_blocks_changed": len(blocks_changed), "effect": effect,
            "breakdown": breakdown, "verdict": _verdict(effect, breakdown)}


def _amount(relative: float, up: str, down: str) -> str:
    """``12.0% slower``, ``3.1 times slower`` past +100%, ``2.5 times faster``."""
    if relative >= 1:
        return f"{1 + relative:.3g} times {up}"
    if relative <= -0.5 and down == "faster":
        return f"{1 / (1 + relative):.3g} times {down}"
    return f"{abs(relative):.1%} {up if relative > 0 else down}"


def _verdict(effect: list[dict], breakdown: list[dict]) -> str:
    step = effect[0]
    total = next(e for e in effect if e["metric"] == "memory.total")
    if step["relative"] is None:
        return "B: no comparable step time"
    speed = ("as fast as A" if abs(step["relative"]) < 5e-4 else
             f"{_amount(step['relative'], 'slower', 'faster')} than A "
             f"({fmt.delta_seconds(step['delta'])} per step)")
    mem = ("the same memory" if not total["relative"] or abs(total["relative"]) < 5e-4 else
           f"{_amount(total['relative'], 'more', 'less')} memory per device "
           f"({fmt.nbytes(total['b'])} vs {fmt.nbytes(total['a'])})")
    why = ""
    if breakdown and abs(step["delta"]) > 0:
        sign = 1 if step["delta"] > 0 else -1
        main = max(breakdown, key=lambda e: sign * e["delta"])
        if sign * main["delta"] > 0:
            why = (f"; mostly {TIME_LABELS[main['metric']]} "
                   f"{fmt.delta_seconds(main['delta'])}")
    return f"B is {speed} and uses {mem}{why}"


def _cell(metric: str, value: float) -> str:
    if metric == "mfu":
        return fmt.pct(value)
    if metric == "tokens_per_s":
        return fmt.count(value)
    if metric.startswith("memory."):
        return fmt.nbytes(value)
    return fmt.seconds(value)


def _label(metric: str) -> str:
    if metric.startswith("memory."):
        kind = metric.split(".", 1)[1]
        return "memory " + MEMORY_LABELS.get(kind, kind)
    return {"step_time_s": "step time", "tokens_per_s": "tokens/s", "mfu": "MFU",
            "bubble_s": "bubble"}.get(metric, TIME_LABELS.get(metric, metric))


def _tables(d: dict) -> list[tuple[str, list[str], list[list[str]], set[int]]]:
    changes = [[c["field"], str(c["a"]), str(c["b"])] for c in d["changes"]]
    if d["placements"]["changed"]:
        changes.append(["parameter placements", "", f"{d['placements']['changed']} changed"])
        changes += [[f"  {e['param']}", e["a"], e["b"]] for e in d["placements"]["examples"]]
    if d["recompute_blocks_changed"]:
        changes.append(["recompute per block", "", f"{d['recompute_blocks_changed']} blocks "
                                                   f"changed"])
    effect = [[_label(e["metric"]), _cell(e["metric"], e["a"]), _cell(e["metric"], e["b"]),
               fmt.change(e["relative"]) if e["relative"] is not None else
               ("=" if not e["delta"] else "new")] for e in d["effect"]
              if e["a"] or e["b"]]
    terms = [[TIME_LABELS[e["metric"]], fmt.seconds(e["a"]), fmt.seconds(e["b"]),
              fmt.delta_seconds(e["delta"])] for e in d["breakdown"]]
    out = [("What changed", ["field", "A", "B"],
            changes or [["(nothing)", "", "the plans make the same decisions"]], set()),
           ("Predicted effect", ["", "A", "B", "change"], effect, {1, 2, 3})]
    if terms:
        out.append(("Step time by term", ["term", "A", "B", "change"], terms, {1, 2, 3}))
    return out


def render_diff(d: dict, a_name: str, b_name: str, fmt_: str = "text") -> str:
    """``text``, ``markdown`` or ``json`` rendering of :func:`plan_diff`'s data."""
    if fmt_ == "json":
        return json.dumps({"a": a_name, "b": b_name, **d}, indent=2) + "\n"
    if fmt_ == "markdown":
        lines = ["# autopar diff", "", f"A = `{a_name}`, B = `{b_name}`", "", d["verdict"]]
        for title, headers, rows, numeric in _tables(d):
            lines += ["", f"## {title}", "", *md_table(headers, rows, numeric)]
        return "\n".join(lines) + "\n"
    lines = [f"A: {a_name}", f"B: {b_name}", d["verdict"]]
    for title, headers, rows, numeric in _tables(d):
        lines += ["", title, *text_table(headers, rows, numeric)]
    return "\n".join(lines) + "\n"
