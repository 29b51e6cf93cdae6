"""Headless Chromium for the HTML report's screenshot tests: render a page, read its pixels."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest


def browser() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


needs_chromium = pytest.mark.skipif(
    browser() is None, reason="no Chromium on this machine (Debian: apt-get install chromium); "
    "the screenshot tests need a browser to draw the HTML report")


def screenshot(html: str, folder: Path, name: str = "page", width: int = 1280,
               height: int = 2400) -> np.ndarray:
    """``html`` as headless Chromium draws it in a ``width`` x ``height`` window: its pixels,
    (height, width, 3) uint8 RGB. ``folder`` holds the page, the PNG and the browser's
    profile."""
    from matplotlib.image import imread

    page, shot = folder / f"{name}.html", folder / f"{name}.png"
    page.write_text(html)
    result = subprocess.run(
        [browser(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
         "--disable-dev-shm-usage", f"--user-data-dir={folder / 'chromium-profile'}",
         f"--window-size={width},{height}", f"--screenshot={shot}", page.as_uri()],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and shot.is_file(), result.stderr[-2000:]
    pixels = imread(shot)
    assert pixels.shape[:2] == (height, width)
    return (pixels[..., :3] * 255).astype("uint8")


def assert_drawn(rgb: np.ndarray) -> None:
    """The page shows text and figures: many colours, some but not most of it inked."""
    flat = rgb.reshape(-1, 3)
    colours = {tuple(p) for p in flat[::97]}
    assert len(colours) > 200, "the page should show text and figures, not one colour"
    inked = (flat.min(axis=1) < 200).mean()
    assert 0.03 < inked < 0.6, f"{inked:.1%} of the page is drawn on"


def pixels_near(rgb: np.ndarray, colour: str, tolerance: int = 8) -> int:
    """How many pixels are within ``tolerance`` of ``colour`` ('#4C72B0') in every channel."""
    want = np.array([int(colour[i:i + 2], 16) for i in (1, 3, 5)])
    return int((np.abs(rgb.reshape(-1, 3).astype(int) - want).max(axis=1) < tolerance).sum())
