"""The report's content as data: every number the renderers print, read from the Plan alone.

``report_data(plan)`` is also what ``autopar report --format json`` prints. Nothing here
re-runs the cost model: a plan written by an older autopar lacks some sections, and the data
says so in ``notes``.
"""

from __future__ import annotations

from autopar.cost.hardware import MEMORY_RISK_FRACTION
from autopar.plan import Plan
from autopar.plan.support import runtime_runs_cp
from autopar.report import fmt
from autopar.report.fmt import MEMORY_KINDS, TIME_LABELS, TIME_TERMS

_ZERO = {0: "none (every data-parallel rank holds all states)",
         1: "stage 1 (optimizer states sharded over dp)",
         2: "stage 2 (gradients and optimizer states sharded over dp)",
         3: "stage 3 (parameters, gradients and optimizer states sharded over dp)"}


def _title(plan: Plan) -> str:
    name = plan.model.get("model_type") or plan.model.get("source", "model")
    return (f"{name} ({plan.model.get('params', 0):,} params), {plan.task} on {plan.devices} x "
            f"{plan.cluster}")


def _stage_rows(plan: Plan) -> list[dict]:
    m = plan.num_microbatches
    blocks = plan.model.get("blocks", [])
    rows = []
    for k, s in enumerate(plan.predicted.stages):
        start, end = s["blocks"]
        names = [b["name"] for b in blocks[start:end]]
        recompute = s.get("recompute_s", 0.0)
        mem = s["memory"]
        rows.append({
            "stage": k, "blocks": [start, end], "num_blocks": end - start,
            "first": names[0] if names else str(start), "last": names[-1] if names else str(end),
            "fwd_s": s["fwd_s"], "bwd_s": s["bwd_s"],
            "compute_s": m * (s["compute_s"] - recompute), "recompute_s": m * recompute,
            "comm_s": m * (s["comm_s"] + s.get("dp_microbatch_s", 0.0)) + s["dp_exposed_s"],
            "bubble_s": s.get("bubble_s"), "memory": {k2: mem.get(k2, 0.0) for k2 in
                                                       (*MEMORY_KINDS, "total")},
            "of_budget": mem["total"] / plan.memory_limit_bytes if plan.memory_limit_bytes
            else None,
        })
    return rows


def _lost_on(chosen: dict, alt: dict, plan: Plan) -> str:
    """The step-time term that grew most against the chosen plan (why the runner-up lost);
    for a faster runner-up, its memory above the risk line, else its worse step under the
    robustness checks."""
    mine = plan.predicted.sensitivity
    limit = plan.memory_limit_bytes
    if (alt["step_time_s"] < plan.predicted.step_time_s and limit
            and alt.get("memory_total", 0.0) > MEMORY_RISK_FRACTION * limit
            >= plan.predicted.memory.get("total", 0.0)):
        return (f"memory: {fmt.pct(alt['memory_total'] / limit)} of the usable memory, above "
                f"{fmt.pct(MEMORY_RISK_FRACTION)}")
    if alt["step_time_s"] < plan.predicted.step_time_s and alt.get("sensitivity") and mine:
        return (f"robustness: worst case {fmt.seconds(max(alt['sensitivity'].values()))} vs "
                f"{fmt.seconds(max(mine.values()))}")
    if not chosen or not alt.get("breakdown"):
        return "-"
    growth = {t: alt["breakdown"].get(t, 0.0) - chosen.get(t, 0.0) for t in TIME_TERMS}
    term = max(growth, key=growth.get)
    if growth[term] <= 0:
        return "-"
    return f"{TIME_LABELS[term]} {fmt.delta_seconds(growth[term])}"


def _runner_ups(plan: Plan) -> list[dict]:
    chosen = plan.predicted.breakdown
    total = plan.predicted.memory["total"]
    out = []
    for a in plan.alternatives:
        mem = a.get("memory_total", 0.0)
        out.append({
            "mesh": a["mesh"], "cp_mode": a.get("cp_mode") if a["mesh"].get("cp", 1) > 1
            else None, "zero_stage": a["zero_stage"], "schedule": a["schedule"],
            "microbatch_size": a["microbatch_size"], "num_microbatches": a["num_microbatches"],
            "sequence_parallel": a.get("sequence_parallel", False),
            "recompute": a.get("recompute_blocks") or {m: None for m in a.get("recompute", [])},
            "offload": a.get("offload", []), "step_time_s": a["step_time_s"],
            "slower": a["slower"], "memory_total": mem,
            "larger": a.get("larger", (mem - total) / total if total else 0.0),
            "mfu": a.get("mfu"), "breakdown": a.get("breakdown", {}),
            "worst_case_s": max(a["sensitivity"].values()) if a.get("sensitivity") else None,
            "sensitivity": a.get("sensitivity", {}),
            "lost_on": _lost_on(chosen, a, plan),
        })
    return out


def _context_parallel(plan: Plan) -> dict | None:
    """Where the search weighed plans with and without context parallelism: the other
    side's best plan (with what it lost on) or why it has none; else None."""
    cp = plan.solver.get("context_parallel")
    if not cp:
        return None
    best = cp.get("best")
    if best is not None:
        best = {**best, "cp_mode": best.get("cp_mode") if best["mesh"].get("cp", 1) > 1
                else None, "lost_on": _lost_on(plan.predicted.breakdown, best, plan)}
    return {**cp, "best": best}


def _robustness(plan: Plan) -> dict | None:
    """The chosen plan's step under the checks, and how the choice among near-fastest plans
    went (None for plans before format 3)."""
    checks = plan.predicted.sensitivity
    robust = plan.solver.get("robust")
    if not checks or not robust:
        return None
    return {"step_time_s": plan.predicted.step_time_s, "checks": dict(checks),
            "worst_case_s": max(checks.values()), **robust}


def _bounds(plan: Plan) -> list[dict]:
    """One entry per bound: is it binding, and the evidence in a sentence."""
    b = plan.solver.get("bounds")
    if not b:
        return []
    out = []
    mem = b["memory"]
    used = (f"uses {fmt.nbytes(mem['used_bytes'])} of {fmt.nbytes(mem['limit_bytes'])} "
            f"({fmt.pct(mem['used_bytes'] / mem['limit_bytes'] if mem['limit_bytes'] else 0)})")
    parts = []
    if mem["faster_rejected"]:
        step = plan.predicted.step_time_s
        best = mem["best_rejected_bound_s"]
        parts.append(f"{mem['faster_rejected']} candidates that might have been up to "
                     f"{fmt.pct((step - best) / step)} faster (lower bound {fmt.seconds(best)}) "
                     f"did not fit")
    if mem["recompute_blocks"]:
        parts.append(f"{mem['recompute_blocks']} blocks recompute to fit")
    if mem["offload"]:
        parts.append(f"offloads {fmt.offload(mem['offload'])} to fit")
    detail = "; ".join(parts) if parts else "no faster candidate was ruled out by memory"
    out.append({"bound": "memory", "binding": mem["binding"], "detail": f"{used}; {detail}"})
    reasons = {"divisibility": "ruled out by divisibility",
               "batch": "ruled out by the global batch",
               "topology": "ruled out by node size",
               "constraints": "ruled out by the constraints"}
    for name, what in reasons.items():
        e = b.get(name, {})
        n = e.get("excluded_meshes", 0)
        detail = f"{n} meshes {what}" + (f" ({'; '.join(e['examples'])})" if e.get("examples")
                                         else "")
        if name == "batch" and plan.mesh["pp"] > 1 and plan.microbatch_size == 1:
            replicas = plan.mesh["dp"] * plan.mesh["ep"]
            detail = (f"each pipeline gets only {plan.num_microbatches} micro-batches of one "
                      f"sequence (global batch {plan.global_batch} / dp*ep {replicas}): a larger "
                      f"global batch would shrink the bubble" + (f"; {detail}" if n else ""))
        if name == "constraints" and e.get("pinned"):
            pins = ", ".join(f"{k}={v}" for k, v in e["pinned"].items())
            detail = (f"pinned {pins}; {detail}; diff against a plan without them to see what "
                      f"they cost")
        if n or e.get("binding"):
            out.append({"bound": name, "binding": bool(e.get("binding")), "detail": detail})
    return out


def _notes(plan: Plan) -> list[str]:
    notes = []
    p = plan.predicted
    if not p.breakdown or "bounds" not in plan.solver:
        notes.append("this plan file was written by an older autopar (format 1): the step-time "
                     "breakdown, per-stage bubbles, runner-ups' breakdowns and bounds are not "
                     "recorded; re-run `autopar compile` to see them")
    if [list(s["blocks"]) for s in p.stages] != [list(s) for s in plan.stages]:
        notes.append(f"the predictions are for stages {[s['blocks'] for s in p.stages]} but the "
                     f"plan has stages {plan.stages} (edited by hand?): re-plan to update them")
    warning = memory_warning(plan)
    if warning:
        notes.append(warning)
    return notes


def memory_warning(plan: Plan) -> str | None:
    """A line when the plan's most loaded device is predicted above MEMORY_RISK_FRACTION of
    the usable memory (which already sets the allocator's fragmentation aside): the scatter of
    that fragmentation between runs may run it out of memory."""
    limit = plan.memory_limit_bytes
    total = plan.predicted.memory.get("total", 0.0)
    if not limit or total <= MEMORY_RISK_FRACTION * limit:
        return None
    robust = plan.solver.get("robust") or {}
    why = (" (nothing within the robust margin of the fastest plan left more headroom)"
           if robust.get("memory_risk") else "")
    return (f"memory risk: the most loaded device is predicted at {fmt.pct(total / limit)} of "
            f"the usable {fmt.nbytes(limit)}, above {fmt.pct(MEMORY_RISK_FRACTION)}: the "
            f"allocator's fragmentation varies between runs and may run it out of memory"
            f"{why}; give it headroom with more devices, recompute or a smaller micro-batch")


def throughput_unit(plan: Plan) -> str:
    """What ``predicted.tokens_per_s`` counts: "tokens" when the model takes token ids, else
    "samples" (the cost model counts a model's batch when no input is integer ids, e.g. a
    classifier's images). A plan without recorded input dtypes counts tokens."""
    dtypes = plan.model.get("input_dtypes")
    if dtypes is None:
        return "tokens"
    shapes = plan.model.get("inputs", {})
    ids = any(dtype.startswith(("int", "uint")) and len(shapes.get(name, ())) >= 2
              for name, dtype in dtypes.items())
    return "tokens" if ids else "samples"


def report_data(plan: Plan) -> dict:
    """Everything the report shows, as plain data."""
    p = plan.predicted
    limit = plan.memory_limit_bytes
    breakdown = dict(p.breakdown)
    bottleneck = None
    if p.stages:
        bottleneck = max(range(len(p.stages)), key=lambda i: p.stages[i]["fwd_s"]
                         + p.stages[i]["bwd_s"])
    return {
        "title": _title(plan),
        "summary": {
            "model": plan.model.get("model_type") or plan.model.get("source"),
            "params": plan.model.get("params"), "task": plan.task, "devices": plan.devices,
            "cluster": plan.cluster, "mesh": dict(plan.mesh),
            "sequence_parallel": plan.sequence_parallel, "schedule": plan.schedule,
            "virtual_stages": plan.virtual_stages, "global_batch": plan.global_batch,
            "microbatch_size": plan.microbatch_size, "num_microbatches": plan.num_microbatches,
            "zero_stage": plan.zero_stage, "zero": _ZERO.get(plan.zero_stage, "?"),
            "recompute": plan.recompute_counts(), "offload": list(plan.offload),
            "parallelisms": dict(plan.parallelisms),
            "step_time_s": p.step_time_s, "tokens_per_s": p.tokens_per_s, "mfu": p.mfu,
            "throughput_unit": throughput_unit(plan),
            "bubble_s": p.bubble_s, "memory": dict(p.memory), "memory_limit_bytes": limit,
            "memory_fraction": p.memory["total"] / limit if limit else None,
            "host_bytes_per_node": p.host_bytes_per_node,
            "precision": dict(plan.precision), "engine": plan.engine,
            "cp_mode": plan.cp_mode, "engine_runs_cp": runtime_runs_cp(plan.engine or "autopar"),
            "capacity_factor": plan.capacity_factor,
            "peft": dict(plan.peft), "trainable_params": plan.trainable_params,
            "model_params": plan.model.get("params", 0),
            "serving": {"prefill_s": p.prefill_s, "decode_s_per_token": p.decode_s_per_token,
                        "context": p.context, "kv_cache_bytes": p.kv_cache_bytes,
                        "max_concurrency": p.max_concurrency} if plan.task == "infer" else None,
        },
        "robustness": _robustness(plan),
        "breakdown": breakdown, "bottleneck_stage": bottleneck,
        "stages": _stage_rows(plan), "runner_ups": _runner_ups(plan), "bounds": _bounds(plan),
        "context_parallel": _context_parallel(plan),
        "solver": {k: plan.solver.get(k) for k in ("gap", "bound_s", "evaluated",
                                                    "pruned_by_bound", "rejected", "timed_out",
                                                    "method", "sharding",
                                                    "tensor_parallel_refused")},
        "block_types": _block_types(plan), "notes": _notes(plan),
    }


def _block_types(plan: Plan) -> list[dict]:
    """Per block type: how many blocks, which recompute modes they got."""
    blocks = plan.model.get("blocks", [])
    by_type: dict[int, dict] = {}
    for b, mode in zip(blocks, plan.recompute, strict=False):
        t = by_type.setdefault(b["type"], {"type": b["type"], "kind": b["kind"],
                                           "first": b["name"], "count": 0, "recompute": {}})
        t["count"] += 1
        t["recompute"][mode] = t["recompute"].get(mode, 0) + 1
    return list(by_type.values())
