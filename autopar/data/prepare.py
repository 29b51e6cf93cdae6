"""Tokenize text files into an autopar token dataset (the format is in autopar.data.dataset).

Inputs, read as UTF-8 (a ``.gz`` suffix is decompressed on the fly):

- ``*.jsonl`` / ``*.ndjson``: one JSON object per line; the document is its ``text_key`` field.
- anything else: plain text; each non-empty line is one document.

Blank lines are skipped. The tokenizer is a Hugging Face ``tokenizer.json`` or, when none is
given, a byte-level BPE trained here on the same inputs and saved as
``PREFIX.tokenizer.json``. Each document is encoded without the tokenizer's own special tokens
(no BOS) and, with ``append_eos``, followed by one end-of-document token. Everything
(tokenizer, .bin, .idx) is written under temporary names and renamed into place at the end, so
a failed run leaves no partial output.
"""

from __future__ import annotations

import gzip
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

from autopar.data.dataset import TokenWriter, dataset_paths, dataset_prefix
from autopar.data.documents import write_meta
from autopar.errors import PlanError

EOS = "<|endoftext|>"
# end-of-document tokens of common tokenizers, in the order they are looked for
EOS_CANDIDATES = (EOS, "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "<|im_end|>")
JSONL_SUFFIXES = (".jsonl", ".ndjson")
_BATCH = 1024  # documents per encode_batch call


def input_kind(path: Path) -> str:
    """``"jsonl"`` or ``"text"`` from the file name (a trailing ``.gz`` is ignored)."""
    name = path.name[:-3] if path.name.endswith(".gz") else path.name
    suffix = Path(name).suffix.lower()
    if suffix in JSONL_SUFFIXES:
        return "jsonl"
    if suffix == ".json":
        raise PlanError(f"{path}: a .json file is not read; write one JSON object per line as "
                        f".jsonl, or plain text with one document per line")
    return "text"


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, line without its newline), decoded as UTF-8 line by line."""
    opener = gzip.open if path.name.endswith(".gz") else open
    lineno = 0
    try:
        with opener(path, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise PlanError(f"{path}:{lineno}: not UTF-8 ({exc.reason} at byte "
                                    f"{exc.start}); convert the file to UTF-8") from None
                if lineno == 1:
                    line = line.removeprefix("\ufeff")
                yield lineno, line.rstrip("\r\n")
    except OSError as exc:  # unreadable file, bad gzip stream
        raise PlanError(f"{path}:{lineno + 1}: cannot read it ({exc}); check the file") from None


def iter_documents(paths: list[Path], text_key: str = "text") -> Iterator[str]:
    """Every document of every input, in order; PlanError naming file and line on bad input."""
    for path in paths:
        kind = input_kind(path)
        for lineno, line in _lines(path):
            if not line.strip():
                continue
            if kind == "text":
                yield line
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise PlanError(f"{path}:{lineno}: not valid JSON ({exc.msg} at column "
                                f"{exc.colno}); each line must be one JSON object") from None
            if not isinstance(obj, dict):
                raise PlanError(f"{path}:{lineno}: a JSON {type(obj).__name__} where an object "
                                f"with a '{text_key}' field was expected")
            if text_key not in obj:
                fields = ", ".join(sorted(map(str, obj))[:8]) or "none"
                raise PlanError(f"{path}:{lineno}: no '{text_key}' field (fields: {fields}); "
                                f"pass --text-key with the field that holds the text")
            text = obj[text_key]
            if not isinstance(text, str):
                raise PlanError(f"{path}:{lineno}: field '{text_key}' is a JSON "
                                f"{type(text).__name__}, not a string")
            if text.strip():
                yield text


def _check_inputs(inputs: list[Path]) -> list[Path]:
    if not inputs:
        raise PlanError("no input files; pass one or more .txt or .jsonl files")
    paths = [Path(p) for p in inputs]
    for path in paths:
        if not path.exists():
            raise PlanError(f"{path}: input file not found; check the path")
        if not path.is_file():
            raise PlanError(f"{path}: not a file; pass the .txt or .jsonl files themselves")
        input_kind(path)
    return paths


def _empty_corpus(paths: list[Path]) -> PlanError:
    names = ", ".join(str(p) for p in paths[:3]) + (" ..." if len(paths) > 3 else "")
    return PlanError(f"no documents in {names}: every line is empty; give files with text")


def train_bpe(paths: list[Path], vocab_size: int, text_key: str = "text"):
    """A byte-level BPE (GPT-2 style, with ``<|endoftext|>`` as id 0) trained on the inputs."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + 1:
        raise PlanError(f"--vocab-size {vocab_size} is too small for a byte-level BPE: it "
                        f"needs at least {len(alphabet) + 1} (256 bytes + {EOS})")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=[EOS],
                                  initial_alphabet=alphabet, show_progress=False)
    seen = 0

    def docs() -> Iterator[str]:
        nonlocal seen
        for text in iter_documents(paths, text_key):
            seen += 1
            yield text

    tok.train_from_iterator(docs(), trainer=trainer)
    if seen == 0:
        raise _empty_corpus(paths)
    return tok


def load_tokenizer(path: str | os.PathLike):
    """A Hugging Face ``tokenizer.json`` (or a folder holding one)."""
    from tokenizers import Tokenizer

    p = Path(path)
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise PlanError(f"tokenizer {p} not found; pass a Hugging Face tokenizer.json, or leave "
                        f"--tokenizer out to train a byte-level BPE on the inputs")
    try:
        return Tokenizer.from_file(str(p)), p
    except Exception as exc:  # the Rust side raises a plain Exception
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise PlanError(f"{p} is not a Hugging Face tokenizer.json ({first})") from None


def eos_id(tok, where: Path | str) -> int:
    """The tokenizer's end-of-document token id."""
    for name in EOS_CANDIDATES:
        i = tok.token_to_id(name)
        if i is not None:
            return int(i)
    raise PlanError(f"tokenizer {where} has none of the end-of-document tokens "
                    f"{', '.join(EOS_CANDIDATES)}; pass --no-eos to write documents without one")


def _vocab_size(tok) -> int:
    vocab = tok.get_vocab(with_added_tokens=True)
    return max(tok.get_vocab_size(with_added_tokens=True), max(vocab.values(), default=-1) + 1)


def prepare(inputs: list[Path], out_prefix: Path, tokenizer: str | None = None,
            vocab_size: int = 4096, text_key: str = "text", append_eos: bool = True) -> dict:
    """Tokenize ``inputs`` into ``out_prefix.bin`` / ``.idx``; returns the run's numbers.

    ``vocab_size`` is the size of the BPE trained when ``tokenizer`` is None (a small corpus
    may stop short of it); with a tokenizer, the dataset's vocabulary is the tokenizer's.
    """
    t0 = time.perf_counter()
    paths = _check_inputs(list(inputs))
    prefix = dataset_prefix(out_prefix)
    trained = tokenizer is None
    if trained:
        tok = train_bpe(paths, vocab_size, text_key)
        tok_path = Path(f"{prefix}.tokenizer.json")
    else:
        tok, tok_path = load_tokenizer(tokenizer)
    t_train = time.perf_counter() - t0
    eos = eos_id(tok, tok_path) if append_eos else None
    vocab = _vocab_size(tok)
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
    tok_tmp = tok_path.with_name(f"{tok_path.name}.tmp{os.getpid()}")
    try:
        with TokenWriter(prefix, vocab) as writer:
            batch: list[str] = []

            def flush() -> None:
                encodings = encode(batch, add_special_tokens=False)
                tail = [eos] if eos is not None else []
                writer.add_documents([e.ids + tail for e in encodings])
                batch.clear()

            for text in iter_documents(paths, text_key):
                batch.append(text)
                if len(batch) >= _BATCH:
                    flush()
            if batch:
                flush()
            if writer.num_documents == 0:
                raise _empty_corpus(paths)
            if eos is not None:  # documents end with it: the runtime can keep them apart
                write_meta(prefix, {"format": "text", "eos_id": eos})
            if trained:
                tok_path.parent.mkdir(parents=True, exist_ok=True)
                tok.save(str(tok_tmp))
                os.replace(tok_tmp, tok_path)
    finally:
        tok_tmp.unlink(missing_ok=True)
    seconds = time.perf_counter() - t0
    bin_path, idx_path = dataset_paths(prefix)
    return {
        "prefix": str(prefix),
        "bin": str(bin_path),
        "idx": str(idx_path),
        "inputs": [str(p) for p in paths],
        "documents": writer.num_documents,
        "tokens": writer.num_tokens,
        "vocab_size": vocab,
        "dtype": writer.dtype.name,
        "eos_id": eos,
        "tokenizer": str(tok_path),
        "tokenizer_trained": trained,
        "train_seconds": round(t_train, 3),
        "seconds": round(seconds, 3),
        "tokens_per_s": round(writer.num_tokens / seconds) if seconds > 0 else None,
    }
