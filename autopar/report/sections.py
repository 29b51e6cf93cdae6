"""The report as titled sections of formatted cells, shared by the text, markdown and HTML
renderers so that all three print the same numbers the same way."""

from __future__ import annotations

from dataclasses import dataclass, field

from autopar.report import fmt
from autopar.report.fmt import MEMORY_KINDS, MEMORY_LABELS, TIME_LABELS, TIME_TERMS


@dataclass
class Section:
    """A titled block: key/value ``pairs``, a table (``headers`` + ``rows``), or ``lines``."""

    title: str
    pairs: list[tuple[str, str]] = field(default_factory=list)
    headers: list[str] = field(default_factory=list)
    rows: list[list[str]] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)
    numeric: set[int] = field(default_factory=set)  # columns aligned right
    anchor: str = ""


def summary_section(d: dict) -> Section:
    """Mesh, batching, schedule, ZeRO, recompute, offload, step time, throughput, memory."""
    s = d["summary"]
    m = s["mesh"]
    schedule = s["schedule"]
    if m["pp"] == 1:
        schedule += " (one stage: no pipeline)"
    elif s["virtual_stages"] > 1:
        schedule += f" (v={s['virtual_stages']} chunks per device)"
    mem = s["memory"]
    pairs = [
        ("mesh", fmt.mesh(m) + ("  (sequence parallel)" if s["sequence_parallel"] else "")
         + (f"  (context parallel: {s.get('cp_mode', 'ring')} attention"
            + ("" if s.get("engine_runs_cp") else "; priced, not run by autopar's runtime")
            + ")" if m.get("cp", 1) > 1 else "")),
        ("batching", f"global {s['global_batch']} = dp*ep {m['dp'] * m['ep']} x micro-batch "
                     f"{s['microbatch_size']} x {s['num_microbatches']} micro-batches"),
        *([("experts", f"capacity factor {s['capacity_factor']:g}: each expert takes at most "
                       f"that many even shares of a sequence's token copies, the rest dropped")]
          if s.get("capacity_factor") is not None else []),
        ("schedule", schedule),
        ("ZeRO", s["zero"]),
        ("recompute", fmt.recompute_counts(s["recompute"])),
        ("offload", fmt.offload(s["offload"])),
        ("step time", f"{fmt.seconds(s['step_time_s'])} (bubble {fmt.seconds(s['bubble_s'])})"),
        ("throughput", f"{fmt.count(s['tokens_per_s'])} {s.get('throughput_unit', 'tokens')}/s, "
                       f"MFU {fmt.pct(s['mfu'])} "
                       f"(model FLOPs: recompute not counted)"),
        ("memory", f"{fmt.nbytes(mem['total'])} of {fmt.nbytes(s['memory_limit_bytes'])} "
                   f"({fmt.pct(s['memory_fraction'])}) on the busiest device"),
        ("by kind", ", ".join(f"{MEMORY_LABELS[k]} {fmt.nbytes(mem.get(k, 0.0))}"
                              for k in MEMORY_KINDS)),
    ]
    if s.get("serving"):
        pairs = _serving_pairs(s) + pairs[-2:]
    if s.get("parallelisms"):  # registered parallelisms the search chose (with their price)
        pairs.insert(6, ("on top", ", ".join(f"{k}={v!r}"
                                              for k, v in s["parallelisms"].items())))
    if s["host_bytes_per_node"]:
        pairs.append(("host memory", f"{fmt.nbytes(s['host_bytes_per_node'])} per node "
                                     f"(offloaded state)"))
    prec = s.get("precision")
    if prec:
        pairs.append(("precision", f"parameters {prec['param']}, compute {prec['compute']}, "
                                   f"gradient reduction {prec['reduce']}"
                                   + (", dynamic loss scaling" if prec.get("loss_scaling")
                                      else "")))
    if s.get("trainable_params"):
        peft = s.get("peft") or {}
        method = peft.get("method", "full fine-tuning")
        if method == "lora":
            method += f" r={peft.get('r')} on {_targets(peft.get('target_modules'))}"
        elif method == "prefix_tuning":
            method += f" with {peft.get('num_virtual_tokens')} virtual tokens per layer"
        elif method in ("adapter", "low_rank_adapter"):
            method += f" of size {peft.get('adapter_size')}"
        elif method == "rdrop":
            method += f" (two dropout passes, KL weight {peft.get('rdrop_alpha')})"
        total = s.get("model_params") or 0
        share = s["trainable_params"] / total if total else 0.0
        frozen = "; the rest are frozen" if s["trainable_params"] < total else ""
        pairs.append(("fine-tuning", f"{method}: {fmt.count(s['trainable_params'])} of "
                                     f"{fmt.count(total)} parameters train "
                                     f"({fmt.pct(share)}){frozen}"))
    if s.get("engine", "autopar") != "autopar":
        pairs.append(("priced for", f"{s['engine']}'s collectives (a plan to export, not to run "
                                    f"with autopar run)"))
    return Section("Summary", pairs=pairs, anchor="summary")


def _targets(targets: object) -> str:
    if targets is None:
        return "the default targets"
    return targets if isinstance(targets, str) else ", ".join(targets)


def robustness_section(d: dict) -> Section | None:
    """The step if communication were 1.5x slower or overlap halved, and the robust choice."""
    r = d.get("robustness")
    if not r:
        return None
    step = r["step_time_s"]
    checks = r["checks"]
    rows = [["as predicted", fmt.seconds(step), "-"]]
    for key, label in (("comm_1.5x_s", "every transfer 1.5x slower"),
                       ("overlap_half_s", "half the overlap")):
        if key in checks:
            rows.append([label, fmt.seconds(checks[key]),
                         fmt.pct((checks[key] - step) / step, signed=True)])
    lines = [f"among the {r['candidates']} plans within {fmt.pct(r['margin'])} of the fastest, "
             f"this one has the smallest worst case ({fmt.seconds(r['chosen_worst_case_s'])})"]
    if r.get("changed"):
        lines.append(f"the fastest plan ({fmt.seconds(r['fastest_step_time_s'])}) was passed "
                     f"over: its worst case is {fmt.seconds(r['fastest_worst_case_s'])}; it is "
                     f"listed among the runner-ups")
    if r.get("passed_over_for_memory"):
        lines.append(f"{r['passed_over_for_memory']} of them were passed over for using more "
                     f"than {fmt.pct(r['memory_risk_fraction'])} of the usable memory")
    if r.get("passed_over_for_offload"):
        lines.append(f"{r['passed_over_for_offload']} of them were passed over for offloading "
                     f"to the host while a plan that keeps every state on the device was near")
    return Section("Robustness", headers=["if", "step", "change"], rows=rows, lines=lines,
                   numeric={1, 2}, anchor="robustness")


def breakdown_section(d: dict) -> Section | None:
    """The step time's terms (None for a plan that does not record them)."""
    b = d["breakdown"]
    if not b:
        return None
    step = d["summary"]["step_time_s"]
    rows = [[TIME_LABELS[t], fmt.seconds(b[t]), fmt.pct(b[t] / step if step else 0)]
            for t in TIME_TERMS if b.get(t)]
    rows.append(["step", fmt.seconds(step), "100.0%"])
    what = "Decoding step" if d["summary"].get("serving") else "Step time"
    return Section(f"{what}, along the bottleneck stage {d['bottleneck_stage']}",
                   headers=["term", "time", "share"], rows=rows, numeric={1, 2},
                   anchor="breakdown")


def stage_time_section(d: dict) -> Section:
    """Per stage: compute, recompute, communication and bubble per step."""
    if d["summary"].get("serving"):
        return _decode_stage_section(d)
    rows = []
    for r in d["stages"]:
        rows.append([str(r["stage"]), f"{r['first']} .. {r['last']} ({r['num_blocks']})",
                     fmt.seconds(r["compute_s"]), fmt.seconds(r["recompute_s"]),
                     fmt.seconds(r["comm_s"]), fmt.seconds(r["bubble_s"]),
                     f"{fmt.seconds(r['fwd_s'])} / {fmt.seconds(r['bwd_s'])}"])
    return Section("Stages: time per step",
                   headers=["stage", "blocks", "compute", "recompute", "communication",
                            "bubble", "fwd / bwd per micro-batch"],
                   rows=rows, numeric={2, 3, 4, 5, 6}, anchor="stage-time",
                   lines=["communication = tensor/expert-parallel collectives of every "
                          "micro-batch + the exposed data-parallel traffic; bubble = the "
                          "stage's idle time in the pipelined forward/backward"])


def _decode_stage_section(d: dict) -> Section:
    """Per stage of a serving plan: one decoding pass, and its compute and collectives."""
    rows = [[str(r["stage"]), f"{r['first']} .. {r['last']} ({r['num_blocks']})",
             fmt.seconds(r["fwd_s"]), fmt.seconds(r["compute_s"] / d["summary"][
                 "num_microbatches"]),
             fmt.seconds(r["comm_s"] / d["summary"]["num_microbatches"]),
             fmt.seconds(r["bubble_s"])] for r in d["stages"]]
    return Section("Stages: one decoding pass",
                   headers=["stage", "blocks", "pass", "weights, cache and compute",
                            "collectives", "idle per step"],
                   rows=rows, numeric={2, 3, 4, 5}, anchor="stage-time",
                   lines=["a pass moves one micro-batch (without stages: every sequence) one "
                          "token through the stage; collectives are tensor/expert-parallel, "
                          "at their latency"])


def stage_memory_section(d: dict) -> Section:
    """Per stage: memory by kind on its busiest device, and its share of the budget."""
    rows = []
    for r in d["stages"]:
        mem = r["memory"]
        rows.append([str(r["stage"]), *(fmt.nbytes(mem[k]) for k in MEMORY_KINDS),
                     fmt.nbytes(mem["total"]), fmt.pct(r["of_budget"])])
    limit = fmt.nbytes(d["summary"]["memory_limit_bytes"])
    return Section(f"Stages: memory per device (budget {limit})",
                   headers=["stage", *(MEMORY_LABELS[k] for k in MEMORY_KINDS), "total",
                            "of budget"],
                   rows=rows, numeric=set(range(1, 9)), anchor="stage-memory")


def runner_up_section(d: dict) -> Section:
    """The runner-ups: their choices, how much slower and larger, what they lost on."""
    rows = []
    for i, a in enumerate(d["runner_ups"], 1):
        rec = a["recompute"]
        rows.append([str(i), fmt.mesh(a["mesh"], a.get("cp_mode"))
                     + (" sp" if a["sequence_parallel"] else ""),
                     f"ZeRO-{a['zero_stage']}", a["schedule"],
                     f"{a['microbatch_size']} x {a['num_microbatches']}",
                     fmt.recompute_short(rec),
                     fmt.offload(a["offload"]), fmt.seconds(a["step_time_s"]),
                     fmt.pct(a["slower"], signed=True),
                     fmt.seconds(a["worst_case_s"]) if a.get("worst_case_s") else "-",
                     fmt.nbytes(a["memory_total"]), fmt.pct(a["larger"], signed=True),
                     a["lost_on"]])
    lines = [] if rows else ["no runner-up: the constraints or the model leave one candidate"]
    if rows:
        lines.append("worst case = the slower of the step with every collective and host "
                     "transfer 1.5x slower and with half the overlap")
    if d.get("context_parallel"):
        lines.append(context_parallel_line(d["context_parallel"]))
    return Section("Why this plan: the runner-ups", rows=rows, lines=lines,
                   headers=["#", "mesh", "ZeRO", "schedule", "micro-batches", "recompute",
                            "offload", "step", "slower", "worst case", "memory", "larger",
                            "lost on"],
                   numeric={7, 8, 9, 10, 11}, anchor="runner-ups")


def context_parallel_line(cp: dict) -> str:
    """Why the plan has (or has not) context parallelism: the best plan of the other side
    and what it lost on, or why there is none."""
    side = f"{cp['rival']} context parallelism"
    best = cp.get("best")
    if best is not None:
        return (f"{side}: the best plan ({fmt.mesh(best['mesh'], best.get('cp_mode'))}) takes "
                f"{fmt.seconds(best['step_time_s'])} ({fmt.pct(best['slower'], signed=True)}), "
                f"memory {fmt.nbytes(best['memory_total'])} "
                f"({fmt.pct(best['larger'], signed=True)}); lost on {best['lost_on']}")
    if cp["over_memory"] and cp.get("least_pruned_bound_s") is None:
        return f"{side}: nothing fits ({cp['over_memory']} candidates over memory)"
    parts = []
    if cp["over_memory"]:
        parts.append(f"{cp['over_memory']} candidates over memory")
    if cp.get("least_pruned_bound_s") is not None:
        parts.append(f"{'the rest' if parts else 'every plan'} at least "
                     f"{fmt.seconds(cp['least_pruned_bound_s'])} (a lower bound: pruned, "
                     f"never fully priced)")
    return f"{side}: " + ("; ".join(parts) or f"{cp['candidates']} candidates, none fitted")


def bounds_section(d: dict) -> Section:
    """Each bound's evidence, which ones bind, and the solver's proof."""
    s = d["solver"]
    rows = [[b["bound"], "binding" if b["binding"] else "not binding", b["detail"]]
            for b in d["bounds"]]
    binding = [b["bound"] for b in d["bounds"] if b["binding"]]
    lines = []
    if d["bounds"]:
        lines.append("binding: " + (", ".join(binding) if binding else
                                    "none (the fastest candidate under the cost model fits)"))
    if s.get("gap") is not None:
        lines.append(
            f"solver: proven gap {s['gap']:.2%}: no plan is faster than "
            f"{fmt.seconds(s.get('bound_s'))} under the cost model ({s.get('evaluated', 0)} "
            f"candidates evaluated, {s.get('pruned_by_bound', 0)} pruned by their lower bound"
            f"{', stopped by the time limit' if s.get('timed_out') else ''})")
    if s.get("tensor_parallel_refused"):
        lines.append("tensor parallelism: a layout was not proposed, it does not run on this "
                     f"model ({s['tensor_parallel_refused']})")
    for name, sol in (s.get("sharding") or {}).items():
        lines.append(f"sharding of {name}: CP-SAT {sol['status']}, "
                     f"{fmt.seconds(sol['objective_s'])} (bound {fmt.seconds(sol['bound_s'])})")
    return Section("Why this plan: bounds and proof", headers=["bound", "", "evidence"],
                   rows=rows, lines=lines, anchor="bounds")


def block_section(d: dict) -> Section:
    """Block types and the recompute modes their blocks got."""
    rows = [[str(t["type"]), t["kind"], str(t["count"]), t["first"],
             fmt.recompute_counts(t["recompute"])] for t in d["block_types"]]
    return Section("Blocks", headers=["type", "kind", "count", "first", "recompute"],
                   rows=rows, numeric={2}, anchor="blocks",
                   lines=["`autopar explain PLAN --block K` shows a block's sharding, its "
                          "alternatives and their costs"])


def _serving_pairs(s: dict) -> list[tuple[str, str]]:
    """A serving plan's summary: the decoding step, the prefill, the cache and what fits."""
    serving, m = s["serving"], s["mesh"]
    n, ctx = s["global_batch"], serving["context"]
    pairs = [
        ("mesh", fmt.mesh(m)),
        ("concurrency", f"{n} sequences of up to {ctx} tokens = dp*ep {m['dp'] * m['ep']} x "
                        f"{s['num_microbatches']} micro-batches of {s['microbatch_size']}"
                        + (" taking turns on the stages" if m["pp"] > 1 else
                           ", decoded together")),
        ("decode", f"{fmt.seconds(serving['decode_s_per_token'])} per token for each "
                   f"sequence (the step with every cache full)"),
        ("prefill", f"{fmt.seconds(serving['prefill_s'])} for all {n} prompts of {ctx} "
                    f"tokens, {s['microbatch_size']} at a time"),
        ("throughput", f"{fmt.count(s['tokens_per_s'])} generated tokens/s, MFU "
                       f"{fmt.pct(s['mfu'])}"),
        ("KV cache", f"{fmt.nbytes(serving['kv_cache_bytes'])} per device"),
    ]
    if serving.get("max_concurrency"):
        pairs.append(("fits", f"at most {serving['max_concurrency']} concurrent sequences of "
                              f"{ctx} tokens in this layout"))
    return pairs


def run_sections(d: dict) -> list[Section]:
    """The run next to the plan (``autopar report DIR --run``): its outcome, then per stage
    and term the predicted and measured time and the error."""
    r = d.get("run")
    if not r:
        return []
    pairs = [("steps", f"{r['steps']}: loss {r['first_loss']:.4f} -> {r['last_loss']:.4f}")]
    if r["eval"]:
        e = r["eval"]
        pairs.append(("evaluation", f"after step {e['step']}: loss {e['loss']:.4f}, perplexity "
                                    f"{e['perplexity']:.2f} ({fmt.count(e['tokens'])} tokens)"))
    unit = d.get("summary", {}).get("throughput_unit", "tokens")
    for key, label, show in (("step_time_s", "step time", fmt.seconds),
                             ("tokens_per_s", f"{unit}/s", fmt.count), ("mfu", "MFU", fmt.pct)):
        v = r[key]
        if v["measured"] is not None:
            err = (v["predicted"] - v["measured"]) / v["measured"] if v["measured"] else None
            pairs.append((label, f"measured {show(v['measured'])}, predicted "
                                 f"{show(v['predicted'])} (error {fmt.pct(err, signed=True)})"))
    out = [Section("The run", pairs=pairs, anchor="run",
                   lines=[] if r["window"] else ["run with --profile for the per-term view"])]
    if r["rows"]:
        rows = []
        for row in r["rows"]:
            show = fmt.nbytes if row["term"] == "memory" else fmt.seconds
            rows.append([str(row["stage"]), row["term"], show(row["predicted"]),
                         show(row["measured"]), fmt.pct(row["error"], signed=True)])
        lo, hi = r["window"]
        out.append(Section(
            f"Measured against predicted, per stage (profiled steps {lo}..{hi - 1})",
            headers=["stage", "term", "predicted", "measured", "error"], rows=rows,
            numeric={2, 3, 4}, anchor="measured",
            lines=["error = (predicted - measured) / measured; communication is what held "
                   "the stage's main thread (exposed); the bubble is its idle time and its "
                   "waits on pipeline neighbours; memory is the peak that tensors held"]
            + _collective_lines(r)))
    return out


def _collective_lines(r: dict) -> list[str]:
    """Each collective's measured exposed time per stage, by the axis it served."""
    lines = []
    for s in r["stages"]:
        comm = {k.removeprefix("comm:"): v for k, v in s["terms_s"].items()
                if k.startswith("comm:") and v > 0}
        if comm:
            lines.append(f"stage {s['stage']} collectives (kind:axis, exposed): " + ", ".join(
                f"{k} {fmt.seconds(v)}" for k, v in sorted(comm.items(), key=lambda kv: -kv[1])))
    return lines


def sections(d: dict) -> list[Section]:
    """Every section of the report, in reading order."""
    out = [summary_section(d), *run_sections(d)]
    if d["notes"]:
        out.append(Section("Notes", lines=d["notes"], anchor="notes"))
    b = breakdown_section(d)
    if b is not None:
        out.append(b)
    out += [stage_time_section(d), stage_memory_section(d)]
    r = robustness_section(d)
    if r is not None:
        out.append(r)
    out += [runner_up_section(d), bounds_section(d), block_section(d)]
    return out
