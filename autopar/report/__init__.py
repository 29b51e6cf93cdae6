"""The strategy report: text, markdown, self-contained HTML with plots, JSON; diff; explain.

Reads only the Plan (search -> Plan -> report): every number was recorded at planning time.
"""

from __future__ import annotations

import json

from autopar.errors import PlanError
from autopar.plan.plan import register_report_renderer
from autopar.report.html import render_html
from autopar.report.run import compare
from autopar.report.sections import sections
from autopar.report.summary import report_data
from autopar.report.text import render_markdown, render_text

FORMATS = ("text", "markdown", "html", "json")


def render(plan, fmt: str = "text", run: dict | None = None) -> str:
    """The report of ``plan`` in ``fmt`` (one of :data:`FORMATS`); ``run``, what a run of it
    logged (:func:`autopar.report.run.load_run`), adds the measured-vs-predicted view."""
    if fmt not in FORMATS:
        raise PlanError(f"report format {fmt!r} is unknown; use one of {', '.join(FORMATS)}")
    data = report_data(plan)
    if run is not None:
        data["run"] = compare(plan, run)
    if fmt == "json":
        return json.dumps(data, indent=2) + "\n"
    secs = sections(data)
    if fmt == "text":
        return render_text(data["title"], secs)
    if fmt == "markdown":
        return render_markdown(data["title"], secs)

    return render_html(plan, data, secs)


# Plan.report delegates here (plan/ does not import the report: see register_report_renderer)
register_report_renderer(render)

__all__ = ["FORMATS", "render"]
