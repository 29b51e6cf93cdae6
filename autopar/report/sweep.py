"""A sweep over device budgets (:func:`autopar.sweep`'s rows) or sequence lengths
(:func:`autopar.search.sweep.sweep_seq`'s) as text, markdown, JSON, or one
self-contained HTML file whose figure marks where the plan's shape changes."""

from __future__ import annotations

import json
import re
from typing import Protocol

from autopar.errors import PlanError
from autopar.plan import Plan
from autopar.plan.schedule import schedule_label
from autopar.report import fmt
from autopar.report.html import figure_html, page_html, section_html
from autopar.report.plots import sweep_png
from autopar.report.sections import Section
from autopar.report.text import render_markdown, render_text

FORMATS = ("text", "markdown", "html", "json")
_LABELS = {"zero_stage": "ZeRO", "microbatch_size": "micro-batch",
           "sequence_parallel": "sequence parallel"}
_REASON_CHARS = 160



class SweepRow(Protocol):
    """One device budget of a sweep as the report reads it (what ``autopar.sweep`` returns:
    :class:`autopar.search.sweep.SweepRow`). The caller hands the rows over; the report does
    not import the search, which sits beside it on the same floor."""

    devices: int
    global_batch: int
    plan: Plan | None
    reason: str | None
    changes: list[dict]
    note: str | None

    @property
    def feasible(self) -> bool: ...

    def shape(self) -> dict[str, object]: ...


def change_label(change: dict) -> str:
    """``tp 1 -> 2``, ``ZeRO 3 -> 2``, ``recompute none -> none 30, full 4``."""
    name = change["field"]

    def value(v: object) -> str:
        if name == "recompute":
            return fmt.recompute_short(v)
        if name == "offload":
            return fmt.offload(v)
        if name == "sequence_parallel":
            return "on" if v else "off"
        return str(v)

    return f"{_LABELS.get(name, name)} {value(change['before'])} -> {value(change['after'])}"


def short_reason(reason: str) -> str:
    """The error's line for a table cell: without its parenthesised detail and, when still
    long, without the middle clauses (the cause and the way out stay), cut at a word near
    160 characters (the JSON keeps the whole line)."""
    text = " ".join(re.sub(r"\s*\([^()]*\)", "", reason).split())
    parts = text.split("; ")
    if len(text) > _REASON_CHARS and len(parts) > 2:
        text = f"{parts[0]}; {parts[-1]}"
    if len(text) <= _REASON_CHARS:
        return text
    return text[:_REASON_CHARS].rsplit(" ", 1)[0].rstrip(",;:") + " ..."


def tokens(n: int) -> str:
    """A sequence length: ``8k`` and ``1M`` for multiples of 1024, else the count."""
    if n % (1024 * 1024) == 0:
        return f"{n // (1024 * 1024)}M"
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def _by_seq(rows: list[SweepRow]) -> bool:
    """Whether the rows sweep sequence lengths (one budget) rather than budgets."""
    return any(r.seq is not None for r in rows)


def _title(rows: list[SweepRow]) -> str:
    plan = next(r.plan for r in rows if r.plan is not None)
    name = plan.model.get("model_type") or plan.model.get("source", "model")
    shapes = list(plan.model.get("inputs", {}).values())
    seq = f", {shapes[0][-1]} tokens per sequence" if shapes and shapes[0] else ""
    if _by_seq(rows):
        seq = f", {tokens(rows[0].seq)} to {tokens(rows[-1].seq)} tokens per sequence"
    budgets = sorted({r.devices for r in rows})
    span = f"{budgets[0]} to {budgets[-1]}" if len(budgets) > 1 else f"{budgets[0]}"
    batches = {r.global_batch for r in rows}
    infer = plan.task == "infer"
    if all(r.global_batch == r.devices for r in rows):
        batch = "one concurrent sequence per device" if infer else \
            "global batch one sequence per device"
    elif len(batches) == 1:
        n = next(iter(batches))
        batch = f"{n} concurrent sequences" if infer else f"global batch {n}"
    else:
        batch = ("concurrent sequences" if infer else "global batch") + " per budget"
    return (f"{name} ({plan.model.get('params', 0):,} params), {plan.task} on {span} x "
            f"{plan.cluster}{seq}, {batch}")


def _schedule(row: SweepRow) -> str:
    p = row.plan
    return f"{schedule_label(p)}, {p.microbatch_size} x {p.num_microbatches}"


def table_section(rows: list[SweepRow]) -> Section:
    """One row per budget: the plan's shape, its predictions and what changed."""
    offloads = any(r.plan is not None and r.plan.offload for r in rows)
    # the batch gets a column only when it varies other than one per device (the title says
    # that), e.g. a latency bound's pick of concurrency
    batches = len({r.global_batch for r in rows}) > 1 and \
        any(r.global_batch != r.devices for r in rows)
    by_seq = _by_seq(rows)
    headers = ["seq" if by_seq else "devices", *(["batch"] if batches else []), "mesh", "ZeRO",
               "pipeline, micro-batch", "recompute", *(["offload"] if offloads else []),
               "step time", "tokens/s", "tokens/s/device", "MFU", "memory/device", "changes"]
    body = []
    for r in rows:
        p = r.plan
        lead = [tokens(r.seq) if by_seq else str(r.devices),
                *([str(r.global_batch)] if batches else [])]
        if p is None:
            body.append([*lead, *["-"] * (len(headers) - len(lead) - 1),
                         "no plan: " + short_reason(r.reason or "")])
            continue
        pred = p.predicted
        used = pred.memory["total"] / p.memory_limit_bytes if p.memory_limit_bytes else None
        body.append([
            *lead, fmt.mesh(p.mesh, p.cp_mode if p.mesh.get("cp", 1) > 1 else None)
            + (" +sp" if p.sequence_parallel else ""),
            str(p.zero_stage), _schedule(r), fmt.recompute_short(p.recompute_counts()),
            *([fmt.offload(p.offload)] if offloads else []), fmt.seconds(pred.step_time_s),
            fmt.count(pred.tokens_per_s), fmt.count(pred.tokens_per_s / r.devices),
            fmt.pct(pred.mfu), f"{fmt.nbytes(pred.memory['total'])} ({fmt.pct(used)})",
            "; ".join(change_label(c) for c in r.changes)])
    numeric = {0, int(batches), headers.index("step time"), headers.index("tokens/s"),
               headers.index("tokens/s/device"), headers.index("MFU"),
               headers.index("memory/device")}
    return Section("Best plan per sequence length" if by_seq else "Best plan per device budget",
                   headers=headers, rows=body, numeric=numeric,
                   anchor="sweep")


def notes_section(rows: list[SweepRow]) -> Section:
    """How to read the table, and what the global batch does to particular budgets."""
    plan = next(r.plan for r in rows if r.plan is not None)
    step = "one decoding step of every sequence" if plan.task == "infer" else \
        "one optimizer step"
    lines = [f"step time is {step}; memory/device is the busiest device, as a share of the "
             f"usable {fmt.nbytes(plan.memory_limit_bytes)}; MFU counts model FLOPs.",
             "pipeline, micro-batch: the schedule (none with one stage), then sequences per "
             "micro-batch x micro-batches per step.",
             "changes: the shape fields that differ from the previous row with a plan; dp "
             "(devices / (pp x cp x tp x ep)) and the number of micro-batches follow the "
             "budget, so they are not counted; cp (cp_mode) is context parallelism: ranks "
             "that split each sequence, and how they exchange keys and values."]
    lines += [f"{tokens(r.seq) if r.seq else r.devices}"
              f"{' tokens' if r.seq else ' devices'}: {r.note}" for r in rows if r.note]
    return Section("Notes", lines=lines, anchor="notes")


def sweep_data(rows: list[SweepRow]) -> dict:
    """What ``--format json`` prints: the title and every row as data."""
    plan = next((r.plan for r in rows if r.plan is not None), None)
    head = {"title": _title(rows)} if plan is not None else {}
    if plan is not None:
        head.update({"model": plan.model.get("model_type") or plan.model.get("source"),
                     "params": plan.model.get("params"), "task": plan.task,
                     "cluster": plan.cluster})
    return {**head, "rows": [r.to_dict() for r in rows]}


def render_sweep(rows: list[SweepRow], fmt_: str = "text") -> str:
    """``rows`` (at least one with a plan) as ``text``, ``markdown``, ``html`` or ``json``."""
    if fmt_ not in FORMATS:
        raise PlanError(f"sweep format {fmt_!r} is unknown; use one of {', '.join(FORMATS)}")
    if not any(r.feasible for r in rows):
        raise PlanError("no budget of the sweep has a plan: there is nothing to draw")
    if fmt_ == "json":
        return json.dumps(sweep_data(rows), indent=2) + "\n"
    title, secs = _title(rows), [table_section(rows), notes_section(rows)]
    if fmt_ == "text":
        return render_text(title, secs, heading="autopar sweep")
    if fmt_ == "markdown":
        return render_markdown(title, secs, heading="autopar sweep")
    return _html(rows, title, secs)


def _html(rows: list[SweepRow], title: str, secs: list[Section]) -> str:
    figure = figure_html(
        sweep_png(rows, [[change_label(c) for c in r.changes] for r in rows]),
        "throughput, MFU and memory per device against the device budget",
        "Dotted lines mark where the plan's shape changes (between two budgets, labelled with "
        "what changed); red bands are budgets without a plan; the dashed line is the usable "
        "memory per device.")
    curves = Section("Throughput, MFU and memory against the budget", anchor="curves")
    body = "".join(section_html(s, {"curves": figure}) for s in (curves, *secs))
    return page_html("autopar sweep", title, body,
                     "every number is the cost model's prediction for the plan autopar.plan "
                     "returns at that budget.")
