"""The report as one self-contained HTML file: inline CSS, figures as base64 PNG, no scripts."""

from __future__ import annotations

from html import escape

from autopar._version import __version__
from autopar.plan import Plan
from autopar.report import fmt
from autopar.report.plots import breakdown_png, memory_png, timeline_png
from autopar.report.run_plots import curves_png, measured_step_png
from autopar.report.sections import Section
from autopar.report.timeline import plan_timeline

_CSS = """
body { font-family: -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; color: #222;
       background: #fafafa; margin: 0; }
main { max-width: 1180px; margin: 0 auto; padding: 24px 32px 48px; background: #fff; }
h1 { font-size: 24px; margin: 0 0 4px; }
h2 { font-size: 18px; margin: 32px 0 8px; border-bottom: 1px solid #ddd; padding-bottom: 4px; }
.sub { color: #555; margin: 0 0 16px; }
.cards { display: flex; gap: 12px; flex-wrap: wrap; margin: 12px 0 8px; }
.card { border: 1px solid #ddd; border-radius: 6px; padding: 10px 16px; min-width: 150px; }
.card .v { font-size: 22px; font-weight: 600; }
.card .k { color: #666; font-size: 12px; text-transform: uppercase; letter-spacing: .04em; }
.bar { height: 6px; background: #eee; border-radius: 3px; margin-top: 6px; }
.bar > div { height: 6px; border-radius: 3px; background: #4C72B0; }
.bar > div.high { background: #C44E52; }
table { border-collapse: collapse; margin: 8px 0; font-size: 13px; }
th, td { border-bottom: 1px solid #e4e4e4; padding: 4px 10px; text-align: left;
         vertical-align: top; white-space: nowrap; }
td:last-child { white-space: normal; }
th { background: #f3f3f3; }
td.n, th.n { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
table.kv td:first-child { font-weight: 600; white-space: nowrap; }
.binding { color: #b03030; font-weight: 600; }
.notes { background: #fff6db; border: 1px solid #f0d890; padding: 8px 14px; border-radius: 4px; }
figure { margin: 8px 0 0; }
figure img { max-width: 100%; }
figcaption, .lines { color: #555; font-size: 13px; }
nav a { margin-right: 14px; font-size: 13px; }
footer { color: #888; font-size: 12px; margin-top: 40px; }
"""


def table_html(s: Section) -> str:
    """``s``'s table; its numeric columns aligned right, a "binding" cell in red."""
    head = "".join(f'<th class="{"n" if i in s.numeric else ""}">{escape(h)}</th>'
                   for i, h in enumerate(s.headers))
    body = []
    for row in s.rows:
        cells = []
        for i, c in enumerate(row):
            cls = "n" if i in s.numeric else ("binding" if c == "binding" else "")
            cells.append(f'<td class="{cls}">{escape(c)}</td>')
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def section_html(s: Section, figures: dict[str, str]) -> str:
    """``s`` as an HTML section, followed by ``figures[s.anchor]`` when there is one."""
    parts = [f'<section id="{s.anchor}"><h2>{escape(s.title)}</h2>']
    if s.anchor == "notes":
        return (parts[0] + '<div class="notes">' + "<br>".join(escape(x) for x in s.lines)
                + "</div></section>")
    if s.pairs:
        parts.append('<table class="kv"><tbody>' + "".join(
            f"<tr><td>{escape(k)}</td><td>{escape(v)}</td></tr>" for k, v in s.pairs)
            + "</tbody></table>")
    if s.rows:
        parts.append(table_html(s))
    if s.lines:
        parts.append('<div class="lines">' + "<br>".join(escape(x) for x in s.lines)
                     + "</div>")
    parts.append(figures.get(s.anchor, ""))
    parts.append("</section>")
    return "".join(parts)


def figure_html(png: str | None, alt: str, caption: str) -> str:
    """An inline PNG figure with its caption; nothing when there is no figure."""
    if not png:
        return ""
    return (f'<figure><img alt="{escape(alt)}" src="data:image/png;base64,{png}">'
            f"<figcaption>{escape(caption)}</figcaption></figure>")


def _cards(d: dict) -> str:
    s = d["summary"]
    used = s["memory_fraction"] or 0.0
    cards = [("step time", fmt.seconds(s["step_time_s"]), ""),
             (f"{s.get('throughput_unit', 'tokens')} / s", fmt.count(s["tokens_per_s"]), ""),
             ("MFU", fmt.pct(s["mfu"]), ""),
             ("memory / device", f"{fmt.nbytes(s['memory']['total'])}",
              f'<div class="bar"><div class="{"high" if used > 0.9 else ""}" '
              f'style="width:{min(used, 1.0) * 100:.1f}%"></div></div>'
              f'<div class="k">{fmt.pct(used)} of {fmt.nbytes(s["memory_limit_bytes"])}</div>'),
             ("mesh", fmt.mesh(s["mesh"]), "")]
    return '<div class="cards">' + "".join(
        f'<div class="card"><div class="k">{escape(k)}</div><div class="v">{escape(v)}</div>'
        f"{extra}</div>" for k, v, extra in cards) + "</div>"


def render_html(plan: Plan, data: dict, secs: list[Section]) -> str:
    """One HTML file with the sections and three figures: the step's timeline per stage, the
    memory per stage against the budget, and where the step time goes (with runner-ups)."""
    segments, simulated = plan_timeline(plan)
    timeline = figure_html(
        timeline_png(plan, segments, simulated), "pipeline timeline of one step",
        f"Simulated from the per-stage forward/backward times ({fmt.seconds(simulated)}); the "
        f"cost model predicts {fmt.seconds(plan.predicted.step_time_s)}."
        + (" Red tails are the tensor/expert-parallel share of each forward and backward."
           if any(s["comm_s"] for s in plan.predicted.stages) else ""))
    figures = {
        "breakdown": figure_html(breakdown_png(data), "step time breakdown",
                                 "Each bar adds up to that plan's predicted step time."),
        "stage-memory": figure_html(memory_png(plan), "memory per stage",
                                    "The busiest device of each stage; the dashed line is the "
                                    "usable memory per device."),
    }
    run = data.get("run")
    measured = ""
    if run:
        measured = figure_html(measured_step_png(run), "measured step beside the predicted one",
                               "Each stage's step as the plan predicted it and as the profiled "
                               "run spent it, term by term.")
        figures["run"] = figure_html(curves_png(run), "loss and throughput of the run",
                                     "The run's training loss (held-out loss dashed) and "
                                     "tokens/s per step; the profiled steps are shaded.")
    body = []
    for s in secs:
        body.append(section_html(s, figures))
        if s.anchor == "summary":
            body.append(f'<section id="timeline"><h2>One step, per stage</h2>{timeline}'
                        f"{measured}</section>")
    nav = "".join(f'<a href="#{s.anchor}">{escape(s.title.split(",")[0])}</a>' for s in secs)
    return page_html("autopar plan", data["title"],
                     f"{_cards(data)}<nav>{nav}</nav>{''.join(body)}",
                     "every number is the cost model's prediction, recorded in the plan file "
                     "at planning time" + (", beside what the run measured." if run else "."))


def page_html(heading: str, subtitle: str, body: str, footer: str) -> str:
    """One self-contained page: the report's inline CSS, ``body`` (HTML), no scripts, nothing
    fetched; ``heading`` and ``subtitle`` (text) name it, ``footer`` (text) closes it."""
    return (f'<!doctype html>\n<html lang="en"><head><meta charset="utf-8">'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<title>{escape(heading)}: {escape(subtitle)}</title><style>{_CSS}</style></head>"
            f'<body><main><h1>{escape(heading)}</h1><p class="sub">{escape(subtitle)}</p>'
            f"{body}<footer>autopar {escape(__version__)}: {escape(footer, quote=False)}</footer>"
            f"</main></body></html>\n")
