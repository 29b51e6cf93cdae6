"""Hugging Face ``datasets`` into autopar token datasets: what :class:`autopar.Trainer` and a
run config's ``data`` read.

A ``datasets.Dataset`` (map-style) or ``datasets.IterableDataset`` (streaming, no length) is
read row by row and written as a token dataset (autopar.data.dataset's format) that every
rank then reads its rows of. Its kind comes from its columns (:func:`dataset_kind`):

* ``input_ids``: already tokenized; each row is one document, written as it is;
* ``messages``: conversations, through the tokenizer's chat template, the loss on the
  assistant turns (autopar.data.instruction);
* ``prompt``/``response`` (or Alpaca's ``instruction``/``output``): instruction pairs, the
  loss on the response;
* the text field (``text`` unless told): plain documents, each followed by the end-of-text
  token, packed into rows across document boundaries; the end token is recorded
  (PREFIX.meta.json) so that the runtime can keep documents apart
  (autopar.data.documents).

A streamed dataset is read only as far as the run needs (``max_tokens``, ``max_rows``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

from autopar.data.dataset import TokenWriter, dataset_prefix
from autopar.data.documents import write_meta
from autopar.data.instruction import pack_instruction
from autopar.errors import PlanError

KINDS = ("tokens", "chat", "instruction", "text")
_BATCH = 256  # documents per tokenizer call


def is_hf_dataset(data: object) -> bool:
    """Whether ``data`` is a Hugging Face ``datasets`` Dataset or IterableDataset."""
    module = type(data).__module__ or ""
    return module.startswith("datasets.") and hasattr(data, "column_names")


def is_streamed(data: object) -> bool:
    """A streaming (iterable) dataset: no length, read once in order."""
    return type(data).__name__ == "IterableDataset"


def _columns(data: object) -> list[str]:
    columns = getattr(data, "column_names", None)
    if columns:
        return list(columns)
    first = next(iter(data), None)  # a stream whose features are not resolved yet
    return sorted(first) if isinstance(first, dict) else []


def dataset_kind(data: object, text_field: str = "text") -> str:
    """One of :data:`KINDS` from the dataset's columns; a PlanError naming them otherwise."""
    columns = _columns(data)
    if "input_ids" in columns:
        return "tokens"
    if "messages" in columns:
        return "chat"
    if {"prompt", "response"} <= set(columns) or {"instruction", "output"} <= set(columns):
        return "instruction"
    if text_field in columns:
        return "text"
    raise PlanError(f"the dataset's columns are {columns}; autopar trains on a "
                    f"'{text_field}' column (dataset_text_field; data.text_field in a run "
                    f"config), 'messages' "
                    f"(conversations), 'prompt'+'response', 'instruction'+'output', or "
                    f"'input_ids'")


def _eos(tok) -> int:
    eos = getattr(tok, "eos_token_id", None)
    if eos is None:
        raise PlanError("the tokenizer has no end-of-sequence token to end each document "
                        "with; set its eos_token")
    return int(eos)


def _texts(rows: Iterable[dict], field: str) -> Iterator[str]:
    for i, row in enumerate(rows):
        text = row.get(field)
        if not isinstance(text, str):
            raise PlanError(f"row {i}: the '{field}' column holds a {type(text).__name__}, "
                            f"not a string")
        if text.strip():
            yield text


def write_text(rows: Iterable[dict], prefix: Path, tok, field: str = "text",
               max_tokens: int | None = None) -> dict:
    """Tokenize the ``field`` of ``rows`` into ``prefix`` (no BOS; each document ends with
    the end-of-text token); stop past ``max_tokens`` tokens."""
    eos = _eos(tok)
    with TokenWriter(prefix, len(tok)) as writer:
        batch: list[str] = []

        def flush() -> None:
            encoded = tok(batch, add_special_tokens=False)["input_ids"]
            writer.add_documents([list(ids) + [eos] for ids in encoded])
            batch.clear()

        # a stream is tokenized a few documents at a time, so that it is read no further
        # than the run needs
        size = _BATCH if max_tokens is None else 16
        for text in _texts(rows, field):
            batch.append(text)
            if len(batch) >= size:
                flush()
                if max_tokens is not None and writer.num_tokens >= max_tokens:
                    break
        if batch:
            flush()
        if writer.num_documents == 0:
            raise PlanError(f"the dataset's '{field}' column has no text; give rows with text")
        write_meta(prefix, {"format": "text", "eos_id": eos})
        return {"documents": writer.num_documents, "tokens": writer.num_tokens}


def write_token_rows(rows: Iterable[dict], prefix: Path, vocab: int,
                     max_tokens: int | None = None) -> dict:
    """Already tokenized rows (``input_ids``) into ``prefix``, one document per row."""
    with TokenWriter(prefix, vocab) as writer:
        for i, row in enumerate(rows):
            ids = [int(t) for t in row["input_ids"]]
            if ids and (min(ids) < 0 or max(ids) >= vocab):
                raise PlanError(f"row {i}: token ids {min(ids)}..{max(ids)} lie outside the "
                                f"model's vocabulary of {vocab}; tokenize with its tokenizer")
            if ids:
                writer.add_document(ids)
            if max_tokens is not None and writer.num_tokens >= max_tokens:
                break
        if writer.num_documents == 0:
            raise PlanError("the dataset's 'input_ids' rows are all empty")
        write_meta(prefix, {"format": "tokens"})  # documents are rows: no end token known
        return {"documents": writer.num_documents, "tokens": writer.num_tokens}


def prepare_hf_dataset(data: object, prefix: str | Path, tok, seq: int, *, vocab: int,
                       text_field: str = "text", max_rows: int | None = None) -> dict:
    """Write ``data`` (a Dataset or IterableDataset) as a token dataset at ``prefix`` for
    rows of ``seq`` tokens; ``tok`` is the model's tokenizer (None only for ``input_ids``
    data), ``vocab`` the model's vocabulary; a stream is read for ``max_rows`` rows at most.
    Returns {"kind", "rows" (whole rows of seq + 1 tokens), "documents"/"pairs", "tokens"}."""
    if not is_hf_dataset(data):
        raise PlanError(f"a dataset is a datasets.Dataset or IterableDataset, got "
                        f"{type(data).__name__}; wrap your rows with datasets.Dataset.from_list")
    kind = dataset_kind(data, text_field)
    if tok is None and kind != "tokens":
        raise PlanError(f"{kind} data needs the model's tokenizer: pass tokenizer=FOLDER (or "
                        f"a model folder that holds one)")
    prefix = dataset_prefix(prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    limit = max_rows if is_streamed(data) else None
    max_tokens = None if limit is None else limit * (seq + 1)
    if tok is not None and len(tok) > vocab:
        raise PlanError(f"the tokenizer has {len(tok)} tokens but the model's vocabulary is "
                        f"{vocab}; pass the model's own tokenizer")
    if kind == "tokens":
        stats = write_token_rows(data, prefix, vocab, max_tokens)
    elif kind == "text":
        stats = write_text(data, prefix, tok, text_field, max_tokens)
    else:
        records = ((f"row {i}", dict(row)) for i, row in enumerate(data))
        stats = pack_instruction(records, prefix, tok, seq, where="the dataset",
                                 max_rows=limit)
        return {"kind": kind, "rows": stats["rows"], "pairs": stats["pairs"],
                "tokens": stats["tokens"], "prefix": str(prefix)}
    return {"kind": kind, "rows": stats["tokens"] // (seq + 1), **stats,
            "prefix": str(prefix)}
