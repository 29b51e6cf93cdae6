"""Text sets written for autopar and shipped with it (nothing can be downloaded at run time):
``tiny-text``, 400 short template sentences (how they were made: :mod:`autopar.data.sets.
build`). They test the plumbing end to end; they say nothing of a model's quality."""

from __future__ import annotations

import json
from pathlib import Path

from autopar.errors import PlanError

HERE = Path(__file__).resolve().parent
TEXT_SETS = {"tiny-text": HERE / "tiny_text.jsonl"}


def text_set_rows(name: str) -> list[dict]:
    """The rows (``{"text": ...}``) of the shipped text set ``name``."""
    path = TEXT_SETS.get(name)
    if path is None:
        raise PlanError(f"no shipped text set {name!r}; autopar ships {', '.join(TEXT_SETS)}")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def load_text_set(name: str = "tiny-text"):
    """The shipped text set ``name`` as a ``datasets.Dataset`` (one ``text`` column)."""
    import datasets

    return datasets.Dataset.from_list(text_set_rows(name))
