"""The figures of a run beside its plan: the measured step next to the predicted one, per stage
and term, and the run's loss and throughput curves (matplotlib, Agg, base64 PNG)."""

from __future__ import annotations

from autopar.report.plots import agg_figure, png_base64, time_unit
from autopar.report.run import TERMS

TERM_COLORS = {"compute": "#4C72B0", "tp/ep comm (exposed)": "#C44E52",
               "dp comm (exposed)": "#8172B3", "bubble": "#BBBBBB", "optimizer": "#937860"}


def measured_step_png(run: dict) -> str | None:
    """Per stage, two bars: the predicted step's terms and the measured ones."""
    rows = run["rows"]
    if not rows:
        return None
    stages = sorted({r["stage"] for r in rows})
    terms = TERMS[:5]
    value = {(r["stage"], r["term"]): r for r in rows}
    bars = []  # (label, {term: seconds})
    for s in stages:
        for which in ("predicted", "measured"):
            bars.append((f"stage {s} {which}",
                         {t: value[(s, t)][which] for t in terms if (s, t) in value}))
    longest = max(sum(b.values()) for _, b in bars)
    scale, unit = time_unit(longest)
    fig = agg_figure(10, 1.3 + 0.42 * len(bars))
    ax = fig.add_subplot()
    for term in terms:
        lefts = [sum(b.get(t, 0.0) for t in terms[:terms.index(term)]) / scale for _, b in bars]
        widths = [b.get(term, 0.0) / scale for _, b in bars]
        if any(widths):
            ax.barh(range(len(bars)), widths, left=lefts, color=TERM_COLORS[term], label=term,
                    height=0.6)
    for y, (_, b) in enumerate(bars):
        ax.text(sum(b.values()) / scale, y, f" {sum(b.values()) / scale:.3g} {unit}",
                va="center", fontsize=8)
    ax.set_yticks(range(len(bars)))
    ax.set_yticklabels([label for label, _ in bars], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, longest / scale * 1.15)
    ax.set_xlabel(f"seconds of one step ({unit})")
    lo, hi = run["window"]
    ax.set_title(f"The step as predicted and as measured (profiled steps {lo}..{hi - 1})",
                 fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    ax.grid(axis="x", alpha=0.3)
    return png_base64(fig)


def curves_png(run: dict) -> str:
    """The run's loss (and held-out loss) and tokens/s, step by step."""
    c = run["curves"]
    fig = agg_figure(10, 3.2)
    loss, speed = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    loss.plot(c["step"], c["loss"], color="#4C72B0", marker="." if len(c["step"]) < 50
              else None, label="training loss")
    if c["eval_step"]:
        loss.plot(c["eval_step"], c["eval_loss"], color="#DD8452", marker="o",
                  linestyle="--", label="held-out loss")
    loss.set_xlabel("step")
    loss.set_ylabel("loss")
    loss.set_title("Loss", fontsize=10)
    loss.legend(fontsize=8, frameon=False)
    loss.grid(alpha=0.3)
    speed.plot(c["step"], c["tokens_per_s"], color="#55A868", marker="." if len(c["step"]) < 50
               else None, label="measured")
    predicted = run["tokens_per_s"]["predicted"]
    if predicted:
        speed.axhline(predicted, color="black", linestyle="--", linewidth=1, label="predicted")
    if run["window"]:
        lo, hi = run["window"]
        speed.axvspan(lo - 0.5, hi - 0.5, color="#EEEEEE", label="profiled")
    speed.set_xlabel("step")
    speed.set_ylabel("tokens / s")
    speed.set_yscale("log")
    speed.set_title("Throughput", fontsize=10)
    speed.legend(fontsize=8, frameon=False)
    speed.grid(alpha=0.3)
    return png_base64(fig)
