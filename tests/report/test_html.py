"""The HTML report: one self-contained file that a real browser renders with its figures."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from autopar.report import fmt


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


def _browser() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(_browser() is None, reason="no Chromium on this machine "
                    "(Debian: apt-get install chromium); the screenshot test needs a browser")
def test_html_renders_in_headless_chromium(llama_tp8_plan, tmp_path) -> None:
    from matplotlib.image import imread

    page = tmp_path / "report.html"
    page.write_text(llama_tp8_plan.report("html"))
    shot = tmp_path / "shot.png"
    width, height = 1280, 2400
    result = subprocess.run(
        [_browser(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
         "--disable-dev-shm-usage", f"--user-data-dir={tmp_path / 'profile'}",
         f"--window-size={width},{height}", f"--screenshot={shot}", page.as_uri()],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and shot.is_file(), result.stderr[-2000:]
    pixels = imread(shot)
    assert pixels.shape[:2] == (height, width)
    rgb = (pixels[..., :3] * 255).astype("uint8").reshape(-1, 3)
    colours = {tuple(p) for p in rgb[:: 97]}
    assert len(colours) > 200, "the page should show text and figures, not one colour"
    inked = (rgb.min(axis=1) < 200).mean()
    assert 0.03 < inked < 0.6, f"{inked:.1%} of the page is drawn on"
    # the figures' colours (forward blue, backward orange) made it to the screen
    for r, g, b in ((0x4C, 0x72, 0xB0), (0xDD, 0x84, 0x52)):
        close = (abs(rgb[:, 0].astype(int) - r) < 8) & (abs(rgb[:, 1].astype(int) - g) < 8) \
            & (abs(rgb[:, 2].astype(int) - b) < 8)
        assert close.sum() > 2000
