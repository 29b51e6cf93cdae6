"""The report's figures (matplotlib, Agg, no pyplot state), as base64 PNG for inline HTML."""

from __future__ import annotations

import base64
import io

from autopar.plan import Plan
from autopar.report.fmt import MEMORY_KINDS, MEMORY_LABELS, TIME_LABELS, TIME_TERMS
from autopar.report.timeline import Segment

SEGMENT_COLORS = {"forward": "#4C72B0", "backward": "#DD8452", "weight": "#55A868",
                  "comm": "#C44E52", "bubble": "#E8E8E8", "dp_comm": "#8172B3",
                  "optimizer": "#937860", "offload": "#DA8BC3"}
SEGMENT_LABELS = {"forward": "forward", "backward": "backward (input grad under zero-bubble)",
                  "weight": "weight grad (deferred)", "comm": "tp/ep communication",
                  "bubble": "bubble (idle)", "dp_comm": "data-parallel comm (exposed)",
                  "optimizer": "optimizer step", "offload": "offload transfers"}
TERM_COLORS = {"compute_s": "#4C72B0", "recompute_s": "#64B5CD", "comm_s": "#C44E52",
               "bubble_s": "#BBBBBB", "dp_comm_s": "#8172B3", "optimizer_s": "#937860",
               "offload_s": "#DA8BC3"}
MEMORY_COLORS = {"params": "#4C72B0", "grads": "#DD8452", "optimizer": "#55A868",
                 "activations": "#C44E52", "kv_cache": "#8172B3", "buffers": "#937860"}


def agg_figure(width: float, height: float):
    """A matplotlib Figure on the Agg canvas (no pyplot state, no display needed)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=110)
    FigureCanvasAgg(fig)
    return fig


def png_base64(fig) -> str:
    """``fig`` as a base64 PNG for an inline ``data:`` image (no timestamp: stable bytes)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight", metadata={"Software": None})
    return base64.b64encode(buf.getvalue()).decode("ascii")


def time_unit(longest: float) -> tuple[float, str]:
    for scale, unit in ((1.0, "s"), (1e-3, "ms"), (1e-6, "us")):
        if longest >= scale:
            return scale, unit
    return 1e-9, "ns"


def timeline_png(plan: Plan, segments: list[Segment], simulated_s: float) -> str:
    """Gantt chart of one step: a row per stage, forward/backward/bubble/communication."""
    stages = plan.predicted.stages
    p = len(stages)
    predicted = plan.predicted.step_time_s
    scale, unit = time_unit(max(simulated_s, predicted))
    fig = agg_figure(11, 1.6 + 0.42 * min(p, 32))
    ax = fig.add_subplot()
    comm_share = [s["comm_s"] / (s["fwd_s"] + s["bwd_s"]) if s["fwd_s"] + s["bwd_s"] else 0.0
                  for s in stages]
    label_mb = plan.num_microbatches * max(plan.virtual_stages, 1) <= 24
    used = set()
    for kind in SEGMENT_COLORS:
        for d in range(p):
            bars = [(s.start / scale, s.duration / scale) for s in segments
                    if s.stage == d and s.kind == kind]
            if not bars:
                continue
            used.add(kind)
            ax.broken_barh(bars, (d - 0.4, 0.8), facecolors=SEGMENT_COLORS[kind],
                           edgecolor="white" if kind != "bubble" else "none", linewidth=0.5,
                           hatch="////" if kind == "bubble" else None)
            if kind in ("forward", "backward") and comm_share[d] > 0.005:
                used.add("comm")
                tails = [(x + w * (1 - comm_share[d]), w * comm_share[d]) for x, w in bars]
                ax.broken_barh(tails, (d - 0.4, 0.8), facecolors=SEGMENT_COLORS["comm"],
                               linewidth=0)
    if label_mb:
        for s in segments:
            if s.kind in ("forward", "backward", "weight") and s.microbatch >= 0:
                ax.text((s.start + s.duration / 2) / scale, s.stage, str(s.microbatch),
                        ha="center", va="center", fontsize=7, color="white")
    ax.axvline(predicted / scale, color="black", linestyle="--", linewidth=1)
    ax.text(predicted / scale, -0.55, f" predicted step {predicted / scale:.3g} {unit}",
            fontsize=8, va="bottom", ha="right" if predicted >= simulated_s * 0.5 else "left")
    ax.set_yticks(range(p))
    ax.set_yticklabels([f"stage {d}\nblocks {s['blocks'][0]}-{s['blocks'][1] - 1}"
                        for d, s in enumerate(stages)], fontsize=8)
    ax.set_ylim(p - 0.5, -0.7)
    ax.set_xlim(0, max(simulated_s, predicted) / scale * 1.01)
    ax.set_xlabel(f"time in one optimizer step ({unit})")
    ax.set_title(f"One step: {plan.schedule}, {plan.num_microbatches} micro-batches per "
                 f"pipeline (numbers are micro-batches)", fontsize=10)
    from matplotlib.patches import Patch

    labels = dict(SEGMENT_LABELS)
    if "weight" not in used:
        labels["backward"] = "backward"
    handles = [Patch(facecolor=SEGMENT_COLORS[k], label=labels[k],
                     hatch="////" if k == "bubble" else None) for k in SEGMENT_COLORS
               if k in used]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.22 - 0.2 / p),
              ncol=4, fontsize=8, frameon=False)
    ax.grid(axis="x", alpha=0.3)
    return png_base64(fig)


def memory_png(plan: Plan) -> str:
    """Stacked memory by kind per stage against the per-device budget."""
    stages = plan.predicted.stages
    fig = agg_figure(max(5.0, 1.2 + 0.6 * len(stages)), 3.6)
    ax = fig.add_subplot()
    xs = list(range(len(stages)))
    bottom = [0.0] * len(stages)
    for kind in MEMORY_KINDS:
        values = [s["memory"].get(kind, 0.0) / 1e9 for s in stages]
        if not any(values):
            continue
        ax.bar(xs, values, bottom=bottom, color=MEMORY_COLORS[kind], label=MEMORY_LABELS[kind],
               width=0.6)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    budget = plan.memory_limit_bytes / 1e9
    ax.axhline(budget, color="black", linestyle="--", linewidth=1)
    ax.text(0.01, budget, f" budget {budget:.3g} GB", ha="left", va="bottom", fontsize=8,
            transform=ax.get_yaxis_transform())
    ax.set_ylim(0, max(budget, max(bottom, default=0.0)) * 1.12)
    ax.set_xticks(xs)
    ax.set_xticklabels([f"stage {i}" for i in xs], fontsize=8,
                       rotation=90 if len(stages) > 12 else 0)
    ax.set_ylabel("GB per device")
    ax.set_title("Memory per device, by stage", fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    ax.grid(axis="y", alpha=0.3)
    return png_base64(fig)


def breakdown_png(data: dict) -> str | None:
    """The step time by term for the chosen plan and each runner-up (why they lost)."""
    if not data["breakdown"]:
        return None
    rows = [("chosen", data["breakdown"])]
    rows += [(f"#{i}", a["breakdown"]) for i, a in enumerate(data["runner_ups"], 1)
             if a["breakdown"]]
    longest = max(sum(b.get(t, 0.0) for t in TIME_TERMS) for _, b in rows)
    scale, unit = time_unit(longest)
    fig = agg_figure(9, 1.2 + 0.38 * len(rows))
    ax = fig.add_subplot()
    for term in TIME_TERMS:
        if not any(b.get(term) for _, b in rows):
            continue
        lefts = [sum(b.get(t, 0.0) for t in TIME_TERMS[:TIME_TERMS.index(term)]) / scale
                 for _, b in rows]
        widths = [b.get(term, 0.0) / scale for _, b in rows]
        ax.barh(range(len(rows)), widths, left=lefts, color=TERM_COLORS[term],
                label=TIME_LABELS[term], height=0.6)
    chosen = sum(rows[0][1].get(t, 0.0) for t in TIME_TERMS)
    for y, (_, b) in enumerate(rows):
        total = sum(b.get(t, 0.0) for t in TIME_TERMS)
        label = f" {total / scale:.3g} {unit}" + (f" ({total / chosen - 1:+.1%})" if y else "")
        ax.text(total / scale, y, label, va="center", fontsize=8)
    ax.set_xlim(0, longest / scale * 1.18)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([name for name, _ in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(f"step time ({unit})")
    ax.set_title("Where the step time goes: the chosen plan and its runner-ups", fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    ax.grid(axis="x", alpha=0.3)
    return png_base64(fig)


def sweep_png(rows: list, labels: list[list[str]]) -> str:
    """Three panels against the device budget (log2 axis), one point per budget with a plan:
    tokens/s and tokens/s per device, MFU, memory per device against the usable memory.
    ``labels[i]`` (what changed, one line each) is written along a dotted line between
    budgets i-1 and i; budgets without a plan are red bands. Rows of a sweep over sequence
    lengths (``seq`` set) are drawn against the length instead."""
    by_seq = any(getattr(r, "seq", None) is not None for r in rows)

    def at_x(r) -> int:
        return r.seq if by_seq else r.devices

    budgets = [at_x(r) for r in rows]
    ok = [r for r in rows if r.plan is not None]
    xs = [at_x(r) for r in ok]
    fig = agg_figure(9, 9)
    top, mid, low = fig.subplots(3, 1, sharex=True, gridspec_kw={"height_ratios": [1.6, 1, 1]})
    top.plot(xs, [r.plan.predicted.tokens_per_s for r in ok], "o-", color="#4C72B0",
             label="tokens/s (left, log)")
    top.set_yscale("log")
    top.set_ylabel("tokens/s")
    per = top.twinx()
    per.plot(xs, [r.plan.predicted.tokens_per_s / r.devices for r in ok], "s--",
             color="#DD8452", label="tokens/s per device (right)")
    per.set_ylim(0, max(r.plan.predicted.tokens_per_s / r.devices for r in ok) * 1.15)
    per.set_ylabel("tokens/s per device")
    handles = top.get_legend_handles_labels()[0] + per.get_legend_handles_labels()[0]
    top.legend(handles=handles, fontsize=8, loc="lower center", bbox_to_anchor=(0.5, 1.0),
               ncol=2, frameon=False)
    mid.plot(xs, [r.plan.predicted.mfu * 100 for r in ok], "o-", color="#55A868")
    mid.set_ylim(0, max(r.plan.predicted.mfu * 100 for r in ok) * 1.2)
    mid.set_ylabel("MFU (%)")
    low.plot(xs, [r.plan.predicted.memory["total"] / 1e9 for r in ok], "o-", color="#C44E52",
             label="busiest device")
    usable = [r.plan.memory_limit_bytes / 1e9 for r in ok]
    low.plot(xs, usable, "k--", linewidth=1, label=f"usable ({max(usable):.3g} GB)")
    low.set_ylim(0, max(usable) * 1.15)
    low.set_ylabel("GB per device")
    low.legend(fontsize=8, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=2,
               frameon=False)
    for i, (r, label) in enumerate(zip(rows, labels, strict=True)):
        if r.plan is None:
            x = at_x(r)
            lo = (budgets[i - 1] * x) ** 0.5 if i else x / 1.3
            hi = (budgets[i + 1] * x) ** 0.5 if i + 1 < len(rows) else x * 1.3
            for ax in (top, mid, low):
                ax.axvspan(lo, hi, color="#C44E52", alpha=0.12, linewidth=0)
            mid.text(at_x(r), 2, "no plan", ha="center", va="bottom", fontsize=8,
                     color="#C44E52")
        elif label and i:
            at = (budgets[i - 1] * at_x(r)) ** 0.5  # halfway on the log axis
            for ax in (top, mid, low):
                ax.axvline(at, color="#555555", linestyle=":", linewidth=1)
            # one rotated line per change keeps neighbouring markers' labels apart
            per.text(at, 0.97, "\n".join(label), transform=per.get_xaxis_transform(),
                     rotation=90, ha="center", va="top", multialignment="right", fontsize=7,
                     color="#333333",
                     bbox={"facecolor": "white", "alpha": 0.8, "edgecolor": "none",
                           "pad": 1})
    low.set_xscale("log", base=2)
    low.set_xticks(budgets)
    low.set_xticklabels([str(b) for b in budgets], fontsize=8)
    from matplotlib.ticker import NullLocator

    low.xaxis.set_minor_locator(NullLocator())  # the log axis' own minor ticks would be labelled
    low.set_xlim(budgets[0] / 1.4, budgets[-1] * 1.4)
    low.set_xlabel("tokens per sequence" if by_seq else "devices")
    for ax in (top, mid, low):
        ax.grid(alpha=0.3)
    return png_base64(fig)
