"""Plain metric functions, and ``load(name)`` objects shaped like Hugging Face ``evaluate``'s.

Each function takes two equally long, non-empty sequences and returns a float in [0, 1] (but
:func:`perplexity`); what a user can get wrong (lengths, types, an unknown metric name) raises
:class:`~autopar.errors.PlanError` in one line.
"""

from __future__ import annotations

import inspect
import math
import re
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from autopar.errors import PlanError

# The answer normalization of SQuAD v1.1's official evaluation script (evaluate-v1.1.py,
# Rajpurkar et al. 2016, "normalize_answer"): lower-case, drop punctuation, drop the articles
# a/an/the, collapse whitespace. The rule is theirs; this code is written for autopar.
_PUNCTUATION = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(?:a|an|the)\b")

# the largest x with math.exp(x) finite in a float64; above it exp raises OverflowError
_MAX_EXP_ARG = math.log(2.0**1023 * (2.0 - 2.0**-52))


def normalize_answer(text: str) -> str:
    """``text`` as SQuAD v1.1 compares answers: lower-case, no punctuation, no articles
    (a, an, the), single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def _as_list(values: Any, what: str) -> list:
    # a string is a sequence too, but passing one is always a mistake here (one answer, not a
    # list of them), so it is refused rather than compared character by character
    if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
        raise PlanError(f"{what} must be a list, got {type(values).__name__}; pass one entry "
                        f"per example")
    return values.tolist() if hasattr(values, "tolist") else list(values)


def _paired(predictions: Any, references: Any) -> tuple[list, list]:
    preds = _as_list(predictions, "predictions")
    refs = _as_list(references, "references")
    if len(preds) != len(refs):
        raise PlanError(f"{len(preds)} predictions but {len(refs)} references; pass one "
                        f"prediction per reference")
    if not preds:
        raise PlanError("no predictions and no references; a metric needs at least one example")
    return preds, refs


def accuracy(predictions: Sequence[Any], references: Sequence[Any]) -> float:
    """The fraction of predictions equal to their reference (labels of any comparable type)."""
    preds, refs = _paired(predictions, references)
    return sum(p == r for p, r in zip(preds, refs, strict=True)) / len(preds)


def exact_match(predictions: Sequence[str], references: Sequence[str],
                normalize: bool = True) -> float:
    """The fraction of predicted strings equal to their reference; with ``normalize`` (the
    default) both are first normalized as SQuAD v1.1 does (:func:`normalize_answer`)."""
    preds, refs = _paired(predictions, references)
    for i, (p, r) in enumerate(zip(preds, refs, strict=True)):
        if not isinstance(p, str) or not isinstance(r, str):
            raise PlanError(f"exact_match compares strings, but example {i} holds "
                            f"{type(p).__name__} and {type(r).__name__}; pass text")
    if normalize:
        preds = [normalize_answer(p) for p in preds]
        refs = [normalize_answer(r) for r in refs]
    return sum(p == r for p, r in zip(preds, refs, strict=True)) / len(preds)


def perplexity(mean_token_loss: float) -> float:
    """exp of a mean per-token cross-entropy (natural log); ``inf`` where exp would overflow."""
    loss = float(mean_token_loss)
    return math.inf if loss > _MAX_EXP_ARG else math.exp(loss)


@dataclass(frozen=True)
class Metric:
    """A named metric: ``compute(predictions=..., references=...)`` returns ``{name: value}``,
    as a metric from Hugging Face ``evaluate.load`` does."""

    name: str
    fn: Callable[..., float]

    def compute(self, *, predictions: Sequence[Any], references: Sequence[Any],
                **kwargs: Any) -> dict[str, float]:
        """Score ``predictions`` against ``references``; extra keywords go to the function
        (``normalize=False`` for exact_match)."""
        options = list(inspect.signature(self.fn).parameters)[2:]
        unknown = sorted(set(kwargs) - set(options))
        if unknown:
            raise PlanError(f"metric '{self.name}' does not take {', '.join(unknown)}; its "
                            f"options are {', '.join(options) or 'none'}")
        return {self.name: self.fn(predictions, references, **kwargs)}


METRICS: dict[str, Callable[..., float]] = {"accuracy": accuracy, "exact_match": exact_match}


def load(name: str) -> Metric:
    """The metric called ``name`` (one of :data:`METRICS`), as ``evaluate.load(name)``."""
    if name not in METRICS:
        raise PlanError(f"unknown metric '{name}'; use one of {', '.join(sorted(METRICS))}")
    return Metric(name, METRICS[name])
