"""What a model is trained to do, read from the plan's captured facts, and the synthetic data
of a classifier.

The rule, in one place (:func:`training_task`), from the first captured input and the first
captured output of ``plan.model``:

* integer token ids in, ``(..., vocab)`` logits out (one more dimension than the ids): a
  language model, trained on next-token cross-entropy over token data;
* a floating-point input (an image, features) in, ``(batch, classes)`` out: a classifier,
  trained on mean cross-entropy against integer labels.

Anything else is refused in one line. A plan written before input dtypes were recorded holds
a language model (the only task the runtime trained then).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from autopar.errors import PlanError
from autopar.plan import Plan

LANGUAGE_MODEL = "language model"
CLASSIFICATION = "classification"


@dataclass(frozen=True)
class TrainingTask:
    """The task of a plan's model: ``kind`` (LANGUAGE_MODEL or CLASSIFICATION), one sample's
    input shape (a language model's: ``(seq,)``), and a classifier's number of classes."""

    kind: str
    sample_shape: tuple[int, ...]
    classes: int | None = None

    @property
    def classifies(self) -> bool:
        return self.kind == CLASSIFICATION


def training_task(plan: Plan) -> TrainingTask:
    """The training task of ``plan``'s model (see the module docstring for the rule); a
    PlanError naming what was captured when it is neither task."""
    inputs = plan.model.get("inputs") or {}
    if not inputs:
        raise PlanError("the plan records no model inputs; re-plan it with this autopar version")
    name, shape = next(iter(inputs.items()))
    dtype = (plan.model.get("input_dtypes") or {}).get(name)
    outputs = [s for s in (plan.model.get("outputs") or {}).values() if s]
    out = outputs[0] if outputs else None
    integer = dtype is None or dtype.startswith(("int", "uint"))
    if integer and (out is None or len(out) == len(shape) + 1):
        return TrainingTask(LANGUAGE_MODEL, tuple(shape[1:]))
    if dtype is not None and dtype.startswith(("float", "bfloat")) and out is not None \
            and len(out) == 2:
        return TrainingTask(CLASSIFICATION, tuple(shape[1:]), int(out[-1]))
    raise PlanError(f"the model takes {name} {dtype} {list(shape)} and returns "
                    f"{list(out) if out is not None else 'no recorded output'}; the runtime "
                    f"trains language models (integer token ids in, (..., vocab) logits out) "
                    f"and classifiers (a floating-point input in, (batch, classes) out)")


def synthetic_samples(step: int, seed: int, global_batch: int, sample_shape: tuple[int, ...],
                      classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s global batch of a classifier: ``(global_batch, *sample_shape)`` fp32
    inputs (standard normal) and ``(global_batch,)`` labels in ``[0, classes)``, a function of
    (seed, step) only, so every plan trains on the same batches."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    inputs = torch.randn((global_batch, *sample_shape), generator=gen)
    labels = torch.randint(0, classes, (global_batch,), generator=gen)
    return inputs, labels


class SyntheticSamples:
    """A classifier's deterministic random samples: rows ``[start, start + count)`` of
    :func:`synthetic_samples`' global batch (each data-parallel rank reads its own rows)."""

    def __init__(self, sample_shape: tuple[int, ...], classes: int) -> None:
        self.sample_shape, self.classes = tuple(sample_shape), int(classes)

    def rows(self, step: int, global_batch: int, seed: int, start: int, count: int
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, labels) of rows ``[start, start + count)`` of step ``step``'s batch."""
        if start < 0 or count < 0 or start + count > global_batch:
            raise ValueError(f"rows [{start}, {start + count}) are not inside a global batch "
                             f"of {global_batch}")
        inputs, labels = synthetic_samples(step, seed, global_batch, self.sample_shape,
                                           self.classes)
        return inputs[start:start + count], labels[start:start + count]

    def __repr__(self) -> str:
        return f"SyntheticSamples(shape={list(self.sample_shape)}, classes={self.classes})"


def open_samples(data: str, task: TrainingTask) -> SyntheticSamples:
    """A classifier's data: ``"synthetic"`` only (a PlanError for a file)."""
    if data != "synthetic":
        raise PlanError(f"--data {data}: a classifier trains on synthetic samples only (the "
                        f"token datasets hold language-model text); drop --data")
    return SyntheticSamples(task.sample_shape, task.classes or 0)
