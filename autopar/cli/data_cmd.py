"""``autopar data ...``: build token datasets for ``autopar run DIR --data PREFIX``."""

from __future__ import annotations

import json
from pathlib import Path

import click

from autopar.cli.common import progress
from autopar.data.instruction import prepare_instruction
from autopar.data.prepare import prepare
from autopar.errors import PlanError


@click.group("data", short_help="Prepare token datasets for `autopar run --data`.")
def data_group() -> None:
    """Prepare training data: text or JSON lines -> PREFIX.bin / PREFIX.idx token files.

    \b
    Examples:
      autopar data prepare corpus.txt --out data/corpus
      autopar data prepare --help
    """


@data_group.command("prepare")
@click.argument("inputs", nargs=-1, required=True, metavar="INPUT...",
                type=click.Path(dir_okay=True, path_type=Path))
@click.option("--out", "out", required=True, type=click.Path(path_type=Path),
              metavar="PREFIX", help="Writes PREFIX.bin and PREFIX.idx (and "
              "PREFIX.tokenizer.json when a tokenizer is trained).")
@click.option("--tokenizer", default=None, type=click.Path(path_type=Path),
              help="A Hugging Face tokenizer.json (or its folder) [default: train a byte-level "
              "BPE on the inputs].")
@click.option("--vocab-size", default=4096, show_default=True, type=click.IntRange(min=1),
              help="Vocabulary of the trained BPE (ignored with --tokenizer).")
@click.option("--text-key", default="text", show_default=True,
              help="The field holding the document in .jsonl inputs.")
@click.option("--eos/--no-eos", default=True, show_default=True,
              help="End every document with the tokenizer's end-of-document token.")
@click.option("--format", "kind", type=click.Choice(["text", "instruction"]), default="text",
              show_default=True,
              help="text: documents (plain text or --text-key of JSON lines); instruction: "
                   "prompt/response JSON lines, tokenized with --tokenizer (the model's "
                   "Hugging Face folder), packed to --seq, loss on responses only.")
@click.option("--seq", type=click.IntRange(min=1), default=None,
              help="--format instruction: the plan's tokens per sequence (rows are packed "
                   "to it).")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@click.option("--quiet", "-q", is_flag=True, help="No progress output.")
def prepare_cmd(inputs: tuple[Path, ...], out: Path, tokenizer: Path | None, vocab_size: int,
                text_key: str, eos: bool, kind: str, seq: int | None, as_json: bool,
                quiet: bool) -> None:
    """Tokenize INPUT files into the token dataset PREFIX.bin / PREFIX.idx.

    A .jsonl (or .ndjson) input holds one JSON object per line, the document in its
    --text-key field; any other file is plain text, one document per non-empty line
    (.gz files are read compressed). Train on the result with `autopar run DIR --data PREFIX`.

    \b
    Examples:
      autopar data prepare corpus.txt --out data/corpus            # trains a 4096-id BPE
      autopar data prepare a.jsonl b.jsonl.gz --out data/web --text-key content
      autopar data prepare wiki.txt --out data/wiki --tokenizer ./llama/tokenizer.json
      autopar data prepare pairs.jsonl --format instruction --tokenizer ./Llama-3.2-1B \\
          --seq 2048 --out data/sft
    """
    if kind == "instruction":
        _prepare_instruction(list(inputs), out, tokenizer, seq, as_json, quiet)
        return

    with progress(f"tokenizing {len(inputs)} file(s) into {out}", quiet):
        stats = prepare(list(inputs), out, tokenizer=str(tokenizer) if tokenizer else None,
                        vocab_size=vocab_size, text_key=text_key, append_eos=eos)
    if as_json:
        click.echo(json.dumps(stats, indent=2))
        return
    how = "trained here" if stats["tokenizer_trained"] else "given"
    click.echo(f"wrote {stats['bin']} and {stats['idx']}: {stats['documents']:,} documents, "
               f"{stats['tokens']:,} tokens ({stats['dtype']})")
    click.echo(f"tokenizer: {stats['tokenizer']} ({how}), vocab {stats['vocab_size']:,}")
    click.echo(f"took {stats['seconds']:.2f} s ({stats['tokens_per_s'] or 0:,} tokens/s)")
    click.echo(f"train on it: autopar run DIR --data {stats['prefix']}")


def _prepare_instruction(inputs: list[Path], out: Path, tokenizer: Path | None,
                         seq: int | None, as_json: bool, quiet: bool) -> None:
    if tokenizer is None or seq is None:
        raise PlanError("--format instruction needs --tokenizer (the model's Hugging Face "
                        "folder) and --seq (the plan's tokens per sequence)")
    with progress(f"tokenizing instruction pairs into {out}", quiet):
        stats = prepare_instruction(inputs, out, tokenizer, seq)
    if as_json:
        click.echo(json.dumps(stats, indent=2))
        return
    click.echo(f"wrote {stats['bin']}, {stats['idx']} and {stats['mask']}: {stats['pairs']:,} "
               f"pairs in {stats['rows']:,} rows of {seq} + 1 tokens, "
               f"{stats['trained_tokens']:,} of {stats['tokens']:,} tokens trained"
               + (f" ({stats['cut']} pairs cut at a row's end)" if stats["cut"] else ""))
    click.echo(f"train on it: autopar run DIR --data {stats['prefix']}")
