"""What :class:`autopar.Trainer` generates: text from the model's current weights, through
:func:`autopar.pipeline` (each rank reads the weights whole and generates the same text)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from autopar.errors import PlanError
from autopar.metrics.tasks import qa_exact_match
from autopar.serve.pipeline import pipeline
from autopar.train.checkpoint import save_checkpoint


@dataclass
class PredictionOutput:
    """What :meth:`Trainer.predict` returns: the generated texts, the references when the
    data had answers, and the metrics computed on them."""

    predictions: list
    label_ids: list | None = None
    metrics: dict = field(default_factory=dict)


def need_tokenizer(trainer):
    """The trainer's tokenizer, or a one-line refusal naming the fix."""
    if trainer.tokenizer is None:
        raise PlanError("this needs the model's tokenizer: pass tokenizer=FOLDER to "
                        "autopar.Trainer")
    return trainer.tokenizer


def generator_source(trainer) -> object:
    """Where the model's current weights are: a checkpoint saved now (whole weights, read
    back in one process by each rank) or, before any training, where the run starts."""
    if trainer._runtime is not None:
        save_checkpoint(trainer._runtime, trainer.output_dir / "checkpoints",
                        trainer.args.save_total_limit or 0)
        return trainer.output_dir
    if trainer.model_input.module is not None:
        return trainer.model_input.module
    return trainer.model_input.init_from or trainer.output_dir


def _device(trainer) -> str:
    if trainer.device_kind == "cpu":
        return "cpu"
    return f"{trainer.device_kind}:{int(os.environ.get('LOCAL_RANK', '0'))}"


def generate_texts(trainer, prompts: list[str], **generation) -> list[str]:
    """The new text for each prompt (greedy, 32 new tokens unless told), one pipeline per
    trained step."""
    pipe = getattr(trainer, "_pipe", None)
    if pipe is None or getattr(trainer, "_pipe_step", None) != trainer.state["global_step"]:
        pipe = pipeline("text-generation", model=generator_source(trainer),
                        tokenizer=need_tokenizer(trainer), device=_device(trainer))
        trainer._pipe, trainer._pipe_step = pipe, trainer.state["global_step"]
    generation.setdefault("max_new_tokens", 32)
    outputs = pipe(list(prompts), return_full_text=False, **generation)
    return [o[0]["generated_text"] for o in outputs]


def predict(trainer, test_dataset: object, **generation) -> PredictionOutput:
    """:meth:`Trainer.predict` (see there)."""
    answers = None
    if isinstance(test_dataset, str):
        prompts = [test_dataset]
    elif isinstance(test_dataset, list) and all(isinstance(p, str) for p in test_dataset):
        prompts = list(test_dataset)
    else:
        rows = [dict(r) for r in test_dataset]
        field_name = trainer.args.dataset_text_field
        column = next((c for c in ("prompt", "question", field_name)
                       if rows and c in rows[0]), None)
        if column is None:
            raise PlanError(f"predict reads prompts from a 'prompt', 'question' or "
                            f"'{field_name}' column; the data has "
                            f"{sorted(rows[0]) if rows else 'no rows'}")
        prompts = [r[column] for r in rows]
        if rows and "answer" in rows[0]:
            answers = [r["answer"] for r in rows]
    texts = generate_texts(trainer, prompts, **generation)
    metrics = {}
    if answers is not None:  # scored as autopar.metrics scores a question-answer set
        records = [{"question": p, "answer": a} for p, a in zip(prompts, answers, strict=True)]
        metrics["exact_match"] = qa_exact_match(lambda _: texts, records)["exact_match"]
    return PredictionOutput(texts, answers, metrics)
