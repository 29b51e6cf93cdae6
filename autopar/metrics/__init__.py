"""Evaluation: metric functions shaped like Hugging Face ``evaluate``'s, scoring a causal LM on
multiple-choice and question-answer sets through callables, and two tiny shipped sets.

Nothing is downloaded: the sets are JSON lines inside this package (``sets/``), found from
this file's location so that an installed wheel finds them too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from autopar.errors import PlanError
from autopar.metrics.scores import (
    METRICS,
    Metric,
    accuracy,
    exact_match,
    load,
    normalize_answer,
    perplexity,
)
from autopar.metrics.tasks import (
    answer_predictions,
    choice_predictions,
    choice_scores,
    multiple_choice_accuracy,
    qa_exact_match,
    set_kind,
)

SETS_DIR = Path(__file__).resolve().parent / "sets"
SETS: dict[str, str] = {"tiny-choice": "tiny_choice.jsonl", "tiny-qa": "tiny_qa.jsonl"}


def load_set(name: str) -> Any:
    """The shipped evaluation set ``name`` (one of :data:`SETS`) as a ``datasets.Dataset``;
    ``sets/README.md`` describes the fields."""
    if name not in SETS:
        raise PlanError(f"unknown evaluation set '{name}'; use one of {', '.join(SETS)}")
    try:
        # datasets is not one of autopar's dependencies and is slow to import: only here
        import datasets
    except ImportError:
        raise PlanError("load_set needs the datasets package; pip install datasets") from None
    lines = (SETS_DIR / SETS[name]).read_text(encoding="utf-8").splitlines()
    return datasets.Dataset.from_list([json.loads(line) for line in lines if line.strip()])


__all__ = [
    "METRICS",
    "SETS",
    "Metric",
    "accuracy",
    "answer_predictions",
    "choice_predictions",
    "choice_scores",
    "exact_match",
    "load",
    "load_set",
    "multiple_choice_accuracy",
    "normalize_answer",
    "perplexity",
    "qa_exact_match",
    "set_kind",
]
