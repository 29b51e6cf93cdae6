"""Prompts in, generated tokens out: the files ``autopar generate`` and ``autopar run
--generate`` (or a generated generate.py run as a script) read, and the lines they print."""

from __future__ import annotations

import json
from pathlib import Path

import click

from autopar.errors import PlanError


def prompt_entries(path: str) -> list[str | list[int]]:
    """Each prompt of FILE as written: a text file's non-empty lines (text), or a JSONL file's
    ``ids`` (a list of token ids) or ``prompt``/``text`` (text); a PlanError naming the file
    and line otherwise."""
    file = Path(path)
    if not file.is_file():
        raise PlanError(f"--prompts {path}: no such file; pass a JSONL of {{\"ids\": [...]}} or "
                        f"{{\"prompt\": \"...\"}} lines, or a text file of one prompt per line")
    entries: list[str | list[int]] = []
    for number, line in enumerate(file.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        if file.suffix != ".jsonl":
            entries.append(line)
            continue
        try:
            record = json.loads(line)
        except ValueError as exc:
            raise PlanError(f"{path}:{number}: not JSON ({exc.msg}); one JSON object a "
                            f"line") from None
        if isinstance(record, dict) and isinstance(record.get("ids"), list):
            ids = record["ids"]
            bad = next((i for i in ids if type(i) is not int or i < 0), None)
            if bad is not None or not ids:
                raise PlanError(f"{path}:{number}: \"ids\" must be a non-empty list of "
                                f"token ids (integers >= 0), found "
                                f"{repr(bad) if ids else 'none'}")
            entries.append(ids)
            continue
        text = record.get("prompt", record.get("text")) if isinstance(record, dict) else None
        if not isinstance(text, str):
            raise PlanError(f"{path}:{number}: expected \"ids\" (token ids) or \"prompt\" "
                            f"(text)")
        entries.append(text)
    if not entries:
        raise PlanError(f"--prompts {path} holds no prompts")
    return entries


def read_prompts(path: str, tokenizer) -> list[list[int]]:
    """Token-id prompts from FILE (:func:`prompt_entries`), text tokenized by
    ``tokenizer``."""
    prompts: list[list[int]] = []
    for number, entry in enumerate(prompt_entries(path), 1):
        if isinstance(entry, list):
            prompts.append(entry)
            continue
        if tokenizer is None:
            raise PlanError(f"{path}: prompt {number} is text, which needs a tokenizer; pass "
                            f"--tokenizer HF_FOLDER, or give token ids as {{\"ids\": [...]}}")
        prompts.append(list(tokenizer(entry)["input_ids"]))
    return prompts


def print_generated(rows: list[list[int]], tokenizer, seconds: float) -> None:
    """One JSON line per prompt on stdout, its new token ids (and their text with a
    ``tokenizer``); the count and tokens/s on stderr."""
    total = 0
    for row in rows:
        total += len(row)
        record: dict = {"new_ids": row}
        if tokenizer is not None:
            record["text"] = tokenizer.decode(row, skip_special_tokens=True)
        click.echo(json.dumps(record))
    click.echo(f"generated {total} tokens for {len(rows)} prompts in {seconds:.2f} s: "
               f"{total / max(seconds, 1e-9):.1f} tokens/s", err=True)
