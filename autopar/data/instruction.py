"""Instruction data: prompt/response pairs tokenized with the model's own tokenizer, packed to
the plan's sequence length, with a loss mask so that only response tokens are trained.

Each JSON line holds ``prompt`` and ``response`` (or Alpaca's ``instruction``, optional
``input`` and ``output``), or a conversation: ``messages``, a list of ``{"role", "content"}``
turns as Hugging Face chat data holds them, rendered by the tokenizer's own chat template, the
loss on the assistant turns (:func:`chat_ids_and_mask`). A pair becomes ``tokenizer(prompt)`` (its special tokens
included, as the model was trained) followed by ``tokenizer(response)`` without special
tokens and the end-of-sequence id. Pairs are packed whole, in order, into rows of exactly
``seq + 1`` tokens (a pair longer than a row is cut at the row's end); the rest of a row is
padding. ``PREFIX.mask`` holds one byte per token: 1 where the token is a response token
(a target the loss counts), 0 for prompt tokens and padding. ``PREFIX.meta.json`` records
the packing length: the windows the trainer reads are exactly the packed rows.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np

from autopar.data.dataset import TokenWriter, dataset_paths, dataset_prefix
from autopar.data.documents import write_meta
from autopar.data.prepare import _check_inputs, _lines
from autopar.errors import PlanError

MASK_SUFFIX = ".mask"



def _pair(record: object, where: str, prompt_key: str, response_key: str) -> tuple[str, str]:
    if not isinstance(record, dict):
        raise PlanError(f"{where}: a JSON {type(record).__name__}, not an object; each line "
                        f"must hold {prompt_key!r} and {response_key!r}")
    if "instruction" in record and prompt_key not in record:  # Alpaca's fields
        extra = record.get("input") or ""
        prompt = record["instruction"] + (f"\n\n{extra}" if extra else "")
        response = record.get("output")
    else:
        prompt, response = record.get(prompt_key), record.get(response_key)
    if not isinstance(prompt, str) or not isinstance(response, str):
        raise PlanError(f"{where}: needs string fields {prompt_key!r} and {response_key!r} "
                        f"(or instruction/output); it has {sorted(record)}")
    return prompt, response


def chat_ids_and_mask(tok, messages: object, where: str) -> tuple[list[int], list[int]]:
    """A conversation's token ids through the tokenizer's own chat template, and its loss mask:
    1 on each assistant turn from its content's first character to the end of its rendered
    turn (the template's end-of-turn text, trailing whitespace excepted), 0 on the system and
    user turns and on the template's role headers. The ids are exactly
    ``tok.apply_chat_template(messages, tokenize=True)``."""
    if not isinstance(messages, list) or not messages or any(
            not isinstance(m, dict) or not isinstance(m.get("role"), str)
            or not isinstance(m.get("content"), str) for m in messages):
        raise PlanError(f"{where}: \"messages\" must be a non-empty list of {{\"role\": ..., "
                        f"\"content\": ...}} objects with string values")
    if not any(m["role"] == "assistant" for m in messages):
        raise PlanError(f"{where}: a conversation with no assistant turn has nothing to train; "
                        f"add one or drop the line")
    if not getattr(tok, "chat_template", None):
        raise PlanError(f"{where}: a conversation needs the tokenizer's chat template, and this "
                        f"tokenizer has none; use prompt/response pairs, or a tokenizer folder "
                        f"whose tokenizer_config.json holds a chat_template")
    if not getattr(tok, "is_fast", False):
        raise PlanError(f"{where}: conversations need a fast tokenizer (tokenizer.json), to "
                        f"map the template's text to tokens")

    def render(turns: list) -> str:
        return tok.apply_chat_template(turns, tokenize=False) if turns else ""

    text = render(messages)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before, upto = render(messages[:i]), render(messages[:i + 1])
        start = upto.find(m["content"], len(before)) if m["content"] else -1
        if not text.startswith(upto) or not upto.startswith(before) or start < 0:
            raise PlanError(f"{where}: this chat template does not render a conversation as "
                            f"its turns one after another, with each assistant message as "
                            f"given; autopar cannot tell which tokens are the assistant's")
        spans.append((start, len(upto.rstrip())))
    encoded = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(encoded["input_ids"])
    mask = [int(any(a <= s and e <= b for a, b in spans) and e > s)
            for s, e in encoded["offset_mapping"]]
    return ids, mask


def load_hf_tokenizer(path: str | os.PathLike):
    """The model's own tokenizer from its local Hugging Face folder, through transformers.

    Never the network: a hub id (``meta-llama/Llama-3.2-1B``) is refused with the command
    that downloads it, rather than fetched behind the user's back on every rank (and hung
    on, or half-written, on a machine without access).
    """
    from transformers import AutoTokenizer

    folder = Path(path)
    if not folder.is_dir():
        what = "a file, not a folder" if folder.exists() else "not a local folder"
        raise PlanError(f"tokenizer {str(path)!r} is {what} (autopar never downloads); "
                        f"download it first, e.g. `huggingface-cli download {path} "
                        f"--local-dir DIR`, and pass DIR")
    try:
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise PlanError(f"cannot load a tokenizer from {path} ({' '.join(str(exc).split())[:160]}"
                        f"); pass the model's Hugging Face folder") from None


def tokenizer_beside(model: object) -> Path | None:
    """The model's own folder when it is a path holding a tokenizer (as a Hub download does),
    else None."""
    if not isinstance(model, (str, os.PathLike)):
        return None
    folder = Path(model)
    return folder if (folder / "tokenizer_config.json").is_file() else None


def prepare_instruction(inputs: list[Path], out_prefix: Path, tokenizer: str | os.PathLike,
                        seq: int, prompt_key: str = "prompt",
                        response_key: str = "response") -> dict:
    """Tokenize, pack and mask instruction pairs into ``out_prefix``; returns the numbers."""
    paths = _check_inputs(list(inputs))
    tok = load_hf_tokenizer(tokenizer)
    stats = pack_instruction(_json_records(paths, prompt_key, response_key), out_prefix, tok,
                             seq, prompt_key, response_key,
                             where=", ".join(str(p) for p in paths))
    return {**stats, "tokenizer": str(tokenizer)}


def _json_records(paths: list[Path], prompt_key: str, response_key: str):
    """(where, record) of every JSON line of the inputs."""
    for path in paths:
        for lineno, line in _lines(path):
            if not line.strip():
                continue
            where = f"{path.name}:{lineno}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                raise PlanError(f"{where}: not valid JSON; each line must be one object "
                                f"with {prompt_key!r} and {response_key!r}") from None
            yield where, record


def record_ids_and_mask(tok, record: object, where: str, prompt_key: str = "prompt",
                        response_key: str = "response") -> tuple[list[int], list[int]]:
    """One instruction record's token ids and loss mask: a conversation (``messages``)
    through the chat template, else a prompt/response pair (see the module docstring)."""
    if isinstance(record, dict) and "messages" in record:  # a conversation
        return chat_ids_and_mask(tok, record["messages"], where)
    prompt, response = _pair(record, where, prompt_key, response_key)
    ids_p = list(tok(prompt)["input_ids"])
    ids_r = list(tok(response, add_special_tokens=False)["input_ids"]) + [tok.eos_token_id]
    return ids_p + ids_r, [0] * len(ids_p) + [1] * len(ids_r)


def pack_instruction(records, out_prefix: Path, tok, seq: int, prompt_key: str = "prompt",
                     response_key: str = "response", where: str = "the data",
                     max_rows: int | None = None) -> dict:
    """Pack ``records`` ((where, record) pairs: prompt/response pairs or conversations) into
    rows of ``seq + 1`` tokens with their loss mask under ``out_prefix`` (see the module
    docstring), with the loaded tokenizer ``tok``; stop once ``max_rows`` rows are full (a
    streamed dataset is read no further than the run needs). Returns the numbers."""
    t0 = time.perf_counter()
    eos = tok.eos_token_id
    if eos is None:
        raise PlanError("the tokenizer has no end-of-sequence token; a response must end with "
                        "one: set its eos_token")
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos
    width = seq + 1
    prefix = dataset_prefix(out_prefix)
    mask_path = Path(f"{prefix}{MASK_SUFFIX}")
    masks: list[np.ndarray] = []
    row_ids: list[int] = []
    row_mask: list[int] = []
    pairs = cut = 0
    with TokenWriter(prefix, len(tok)) as writer:

        def close_row() -> None:
            fill = width - len(row_ids)
            writer.add_document(row_ids + [pad] * fill)
            masks.append(np.array(row_mask + [0] * fill, dtype=np.uint8))
            row_ids.clear()
            row_mask.clear()

        for place, record in records:
            ids, mask = record_ids_and_mask(tok, record, place, prompt_key, response_key)
            if len(ids) > width:
                ids, mask = ids[:width], mask[:width]
                cut += 1
            if len(row_ids) + len(ids) > width:
                close_row()
                if max_rows is not None and len(masks) >= max_rows:
                    break
            row_ids.extend(ids)
            row_mask.extend(mask)
            pairs += 1
        if row_ids and (max_rows is None or len(masks) < max_rows):
            close_row()
        if pairs == 0:
            raise PlanError(f"no instruction pairs in {where}")
        mask = np.concatenate(masks)
        tmp = mask_path.with_name(mask_path.name + f".tmp{os.getpid()}")
        mask.tofile(tmp)
        os.replace(tmp, mask_path)
        write_meta(prefix, {"format": "instruction", "seq": seq, "eos_id": eos,
                            "pairs": pairs, "cut": cut})
    bin_path, idx_path = dataset_paths(prefix)
    seconds = time.perf_counter() - t0
    return {"prefix": str(prefix), "bin": str(bin_path), "idx": str(idx_path),
            "mask": str(mask_path), "pairs": pairs, "rows": len(masks), "cut": cut,
            "tokens": int(mask.size), "trained_tokens": int(mask.sum()), "seq": seq,
            "vocab_size": len(tok), "seconds": round(seconds, 3)}
