"""``autopar report DIR --run`` on a trained and profiled artifact: the HTML page holds the run's
figures and its measured-against-predicted table, and headless Chromium draws them."""

from __future__ import annotations

import html as html_lib
import re

import pytest

from autopar.plan import Plan

from ..cli.test_inspect import run_cli
from .browser import assert_drawn, needs_chromium, pixels_near, screenshot

pytestmark = pytest.mark.dist  # the trained_pp2 fixture trains on 2 gloo processes

TERMS = ["compute", "tp/ep comm (exposed)", "dp comm (exposed)", "bubble", "optimizer", "step",
         "memory"]


@pytest.fixture(scope="module")
def run_page(trained_pp2, tmp_path_factory) -> str:
    art, _ = trained_pp2
    out = tmp_path_factory.mktemp("run-report") / "report.html"
    made = run_cli("report", str(art), "--run", "--out", str(out))
    assert made.returncode == 0, made.stderr
    assert made.stdout == "" and f"wrote {out}" in made.stderr
    return out.read_text()


def test_run_report_html_is_self_contained_with_the_runs_figures_and_table(run_page) -> None:
    page = run_page
    assert page.startswith("<!doctype html>")
    assert not re.search(r'(src|href)="(https?:)?//', page) and "<script" not in page
    images = dict(re.findall(r'<img alt="([^"]+)" src="data:image/png;base64,'
                             r'([A-Za-z0-9+/=]+)"', page))
    assert list(images) == ["pipeline timeline of one step",
                            "measured step beside the predicted one",
                            "loss and throughput of the run", "step time breakdown",
                            "memory per stage"]
    assert all(len(data) > 10_000 for data in images.values())
    # the measured step sits beside the predicted timeline; the curves in the run's section
    timeline = page[page.index('<section id="timeline">'):]
    timeline = timeline[:timeline.index("</section>")]
    assert 'alt="measured step beside the predicted one"' in timeline
    run = page[page.index('<section id="run">'):]
    run = run[:run.index("</section>")]
    assert 'alt="loss and throughput of the run"' in run
    assert "4: loss " in run and "after step 4: loss " in run  # 4 steps, evaluated at the end
    # the table: per stage, each term's predicted and measured value and the error
    measured = page[page.index('<section id="measured">'):]
    measured = measured[:measured.index("</section>")]
    assert "Measured against predicted, per stage (profiled steps 1..3)" in measured
    headers = re.findall(r"<th[^>]*>([^<]*)</th>", measured)
    assert headers == ["stage", "term", "predicted", "measured", "error"]
    rows = [[html_lib.unescape(c) for c in re.findall(r"<td[^>]*>([^<]*)</td>", row)]
            for row in re.findall(r"<tr>(.*?)</tr>", measured)[1:]]
    assert [(r[0], r[1]) for r in rows] == [(s, t) for s in "01" for t in TERMS]
    by = {(r[0], r[1]): r for r in rows}
    for stage in "01":
        assert by[(stage, "compute")][3].endswith(("ms", "us")), by[(stage, "compute")]
        assert by[(stage, "step")][4].endswith("%")  # a measured step: an error
        assert by[(stage, "memory")][3].endswith("B")
    assert "send_recv:pp" in measured  # the collectives by kind and axis


@needs_chromium
def test_run_report_renders_in_headless_chromium(run_page, trained_pp2, tmp_path) -> None:
    """The run's page as Chromium draws it, against the same plan's page without the run (one
    tall window, so both pages are drawn whole): the run's figures add the measured bars
    (compute blue, bubble grey, optimizer brown) and the curves (held-out loss orange,
    throughput green)."""
    art, _ = trained_pp2
    height = 4800
    with_run = screenshot(run_page, tmp_path, "run", height=height)
    plan_only = screenshot(Plan.load(art / "plan.yaml").report("html"), tmp_path, "plan",
                           height=height)
    assert_drawn(with_run)
    inked_rows = (with_run.min(axis=2) < 200).any(axis=1).nonzero()[0]
    assert inked_rows.max() < height - 100, "the page is longer than the window"
    for colour, more in (("#4C72B0", 10_000), ("#BBBBBB", 5_000), ("#937860", 800),
                         ("#DD8452", 100), ("#55A868", 300)):
        added = pixels_near(with_run, colour) - pixels_near(plan_only, colour)
        assert added > more, (colour, added)
