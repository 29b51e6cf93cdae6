"""Scoring a causal language model on the two kinds of evaluation set, through callables.

The model is reached only through ``logits_fn`` (ids -> logits) or ``generate_fn`` (prompts ->
new text), so the caller may run it under any parallel layout: one process, a tensor-parallel
group, a pipeline. Multiple-choice items are scored by log-likelihood as lm-evaluation-harness
does (EleutherAI, ``loglikelihood`` requests, ``acc``): each choice's score is the sum of the
log-probabilities of its tokens given the question before them, and the prediction is the
choice with the highest score.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from autopar.errors import PlanError
from autopar.metrics.scores import accuracy, normalize_answer

LogitsFn = Callable[[torch.Tensor], torch.Tensor]  # LongTensor[b, s] -> FloatTensor[b, s, v]
GenerateFn = Callable[[list[str]], list[str]]  # prompts -> the new text of each
DEFAULT_BATCH = 32  # sequences per logits_fn call when the caller does not fix it


def _columns(records_or_dataset: Any) -> list[str]:
    names = getattr(records_or_dataset, "column_names", None)  # a datasets.Dataset
    if names is not None:
        return list(names)
    records = list(records_or_dataset)
    if not records or not isinstance(records[0], Mapping):
        raise PlanError("the evaluation set holds no records; pass a list of dicts or a "
                        "datasets.Dataset")
    return list(records[0])


def set_kind(records_or_dataset: Any) -> str:
    """``"multiple_choice"`` for records with ``choices``, ``"qa"`` for records with
    ``question`` and ``answer`` (read from a Dataset's columns or the first record's keys)."""
    columns = _columns(records_or_dataset)
    if "choices" in columns:
        return "multiple_choice"
    if "question" in columns and "answer" in columns:
        return "qa"
    raise PlanError(f"cannot tell the set's kind from its columns {columns}; a multiple-choice "
                    f"set needs question, choices, answer and a QA set question, answer")


def _token_ids(tokenizer: Any, text: str, special: bool = True) -> list[int]:
    return list(tokenizer(text, add_special_tokens=special)["input_ids"])


def _choice_sequence(tokenizer: Any, question: str, choice: str) -> tuple[list[int], int]:
    """The ids of question + " " + choice, and where the choice's tokens start."""
    context = _token_ids(tokenizer, question)
    whole = _token_ids(tokenizer, question + " " + choice)
    if len(whole) > len(context) and whole[:len(context)] == context:
        return whole, len(context)
    # the tokenizer merged across the boundary (or the question ends in a special token): the
    # question and the choice are tokenized apart, as lm-evaluation-harness does
    return context + _token_ids(tokenizer, " " + choice, special=False), len(context)


def _checked_choice_record(record: Any, index: int) -> tuple[str, list[str]]:
    if not isinstance(record, Mapping) or not isinstance(record.get("question"), str):
        raise PlanError(f"record {index} has no 'question' string; a multiple-choice record "
                        f"holds question (str), choices (list of str), answer (int)")
    choices = record.get("choices")
    if (not isinstance(choices, Sequence) or isinstance(choices, str) or not choices
            or not all(isinstance(c, str) for c in choices)):
        raise PlanError(f"record {index}'s 'choices' is not a non-empty list of strings; "
                        f"give each record its choices as text")
    return record["question"], list(choices)


def _pad_id(tokenizer: Any) -> int:
    for name in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, int):
            return value
    return 0


def _continuation_scores(logits_fn: LogitsFn, sequences: list[tuple[list[int], int]],
                         pad_id: int, width: int | None, batch_size: int | None) -> list[float]:
    """Sum of log p(token | tokens before) over each sequence's tokens from its start index,
    in right-padded batches (the model is causal: padding after a token cannot change it)."""
    longest = max(len(ids) for ids, _ in sequences)
    if width is not None and longest > width:
        raise PlanError(f"a choice sequence has {longest} tokens but width is {width}; pass "
                        f"width >= {longest} or shorten the questions")
    rows_per_call = batch_size or DEFAULT_BATCH
    scores: list[float] = []
    for first in range(0, len(sequences), rows_per_call):
        chunk = sequences[first:first + rows_per_call]
        columns = width or max(len(ids) for ids, _ in chunk)
        rows = batch_size or len(chunk)  # a fixed batch: rows past the chunk are all padding
        ids = torch.full((rows, columns), pad_id, dtype=torch.long)
        for row, (tokens, _) in enumerate(chunk):
            ids[row, :len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        with torch.no_grad():
            logits = logits_fn(ids)
        if logits.dim() != 3 or tuple(logits.shape[:2]) != (rows, columns):
            raise PlanError(f"logits_fn returned shape {tuple(logits.shape)} for ids of shape "
                            f"{(rows, columns)}; return logits[batch, seq, vocab]")
        # float32 for the sum: bf16 log-probabilities would round the comparison between choices
        logprobs = torch.log_softmax(logits.detach().float().cpu(), dim=-1)
        for row, (tokens, start) in enumerate(chunk):
            positions = torch.arange(start, len(tokens))
            targets = torch.tensor(tokens[start:], dtype=torch.long)
            scores.append(float(logprobs[row, positions - 1, targets].sum()))
    return scores


def choice_scores(logits_fn: LogitsFn, tokenizer: Any, records: Iterable[Mapping],
                  width: int | None = None, batch_size: int | None = None) -> list[list[float]]:
    """Each record's choices' log-likelihoods given its question (see the module's docstring).

    ``logits_fn`` is called on right-padded LongTensor batches (the tokenizer's pad id, else
    its eos id, else 0). With ``width`` and/or ``batch_size`` every call has exactly that many
    columns and/or rows, for a caller whose model needs one fixed shape.
    """
    records = list(records)
    if not records:
        raise PlanError("no records to score; pass at least one multiple-choice record")
    for name, value in (("width", width), ("batch_size", batch_size)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise PlanError(f"{name} must be a positive int or None, got {value!r}")
    sequences, counts = [], []
    for index, record in enumerate(records):
        question, choices = _checked_choice_record(record, index)
        for choice in choices:
            ids, start = _choice_sequence(tokenizer, question, choice)
            if start == 0 or start == len(ids):
                raise PlanError(f"record {index}: the question or the choice {choice!r} "
                                f"tokenizes to nothing; give both some text")
            sequences.append((ids, start))
        counts.append(len(choices))
    flat = _continuation_scores(logits_fn, sequences, _pad_id(tokenizer), width, batch_size)
    out, at = [], 0
    for count in counts:
        out.append(flat[at:at + count])
        at += count
    return out


def choice_predictions(logits_fn: LogitsFn, tokenizer: Any, records: Iterable[Mapping],
                       width: int | None = None, batch_size: int | None = None) -> list[int]:
    """The index of the most likely choice of each record (the first one on a tie)."""
    scores = choice_scores(logits_fn, tokenizer, records, width=width, batch_size=batch_size)
    return [max(range(len(s)), key=s.__getitem__) for s in scores]


def multiple_choice_accuracy(logits_fn: LogitsFn, tokenizer: Any, records: Iterable[Mapping],
                             **kw: Any) -> dict[str, float | int]:
    """``{"accuracy": fraction of records whose predicted choice is their answer, "count"}``;
    ``kw`` goes to :func:`choice_predictions` (width, batch_size)."""
    records = list(records)
    answers = []  # checked before the model runs: a bad answer should not cost a forward pass
    for index, record in enumerate(records):
        _, choices = _checked_choice_record(record, index)
        answer = record.get("answer")
        in_range = isinstance(answer, int) and 0 <= answer < len(choices)
        if isinstance(answer, bool) or not in_range:
            raise PlanError(f"record {index}'s answer {answer!r} is not a choice index in "
                            f"0..{len(choices) - 1}; give the index of the right choice")
        answers.append(answer)
    predictions = choice_predictions(logits_fn, tokenizer, records, **kw)
    return {"accuracy": accuracy(predictions, answers), "count": len(records)}


def _first_line(text: str) -> str:
    # leading whitespace first: a model often opens its answer with a newline or a space
    lines = text.strip().splitlines()
    return lines[0].strip() if lines else ""


def answer_predictions(generate_fn: GenerateFn, records: Iterable[Mapping]) -> list[str]:
    """Each record's prediction: the first line of ``generate_fn``'s text for its question."""
    records = list(records)
    if not records:
        raise PlanError("no records to answer; pass at least one question-answer record")
    prompts = []
    for index, record in enumerate(records):
        if not isinstance(record, Mapping) or not isinstance(record.get("question"), str):
            raise PlanError(f"record {index} has no 'question' string; a QA record holds "
                            f"question (str) and answer (str or list of str)")
        prompts.append(record["question"])
    texts = list(generate_fn(prompts))
    if len(texts) != len(prompts) or not all(isinstance(t, str) for t in texts):
        raise PlanError(f"generate_fn returned {len(texts)} items for {len(prompts)} prompts; "
                        f"return one string (the new text) per prompt")
    return [_first_line(text) for text in texts]


def _acceptable(record: Mapping, index: int) -> list[str]:
    answer = record.get("answer")
    answers = [answer] if isinstance(answer, str) else answer
    if (not isinstance(answers, Sequence) or not answers
            or not all(isinstance(a, str) for a in answers)):
        raise PlanError(f"record {index}'s answer {answer!r} is not a string or a non-empty "
                        f"list of strings; give the acceptable answers as text")
    return list(answers)


def qa_exact_match(generate_fn: GenerateFn, records: Iterable[Mapping]) -> dict[str, float | int]:
    """``{"exact_match": fraction of records whose prediction equals one of their acceptable
    answers after SQuAD normalization, "count"}``."""
    records = list(records)
    acceptable = [_acceptable(record, index) for index, record in enumerate(records)
                  if isinstance(record, Mapping)]  # a non-mapping is refused by the next call
    predictions = answer_predictions(generate_fn, records)
    hits = sum(any(normalize_answer(prediction) == normalize_answer(a) for a in answers)
               for prediction, answers in zip(predictions, acceptable, strict=True))
    return {"exact_match": hits / len(records), "count": len(records)}
