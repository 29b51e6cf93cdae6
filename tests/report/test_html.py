"""The HTML report: one self-contained file that a real browser renders with its figures."""

from __future__ import annotations

import re

from autopar.report import fmt

from .browser import assert_drawn, needs_chromium, pixels_near, screenshot


def test_html_is_self_contained_with_three_figures(llama_tp8_plan) -> None:
    html = llama_tp8_plan.report("html")
    assert html.startswith("<!doctype html>")
    images = re.findall(r'<img alt="([^"]+)" src="data:image/png;base64,([A-Za-z0-9+/=]+)"', html)
    assert [alt for alt, _ in images] == ["pipeline timeline of one step", "step time breakdown",
                                          "memory per stage"]
    assert all(len(data) > 10_000 for _, data in images)
    # nothing is fetched: no external scripts, styles, images or fonts
    assert not re.search(r'(src|href)="(https?:)?//', html) and "<script" not in html
    assert fmt.seconds(llama_tp8_plan.predicted.step_time_s) in html
    assert html.count("<tr>") > 20


@needs_chromium
def test_html_renders_in_headless_chromium(llama_tp8_plan, tmp_path) -> None:
    rgb = screenshot(llama_tp8_plan.report("html"), tmp_path, "report")
    assert_drawn(rgb)
    # the figures' colours (forward blue, backward orange) made it to the screen
    for colour in ("#4C72B0", "#DD8452"):
        assert pixels_near(rgb, colour) > 2000, colour
