"""``autopar export DIR --to hf OUT``: the trained model as a Hugging Face folder;
``autopar export DIR|MODEL --to onnx OUT``: its cached prefill and decode step as ONNX."""

from __future__ import annotations

import click

from autopar.cli.common import progress
from autopar.errors import PlanError
from autopar.serve.hf_export import export_hf


def _bytes(text: str) -> int:
    units = {"KB": 2**10, "MB": 2**20, "GB": 2**30, "TB": 2**40}
    t = text.strip().upper()
    for suffix, scale in units.items():
        if t.endswith(suffix):
            try:
                return int(float(t[:-2]) * scale)
            except ValueError:
                break
    try:
        return int(t)
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a size such as 5GB or 500MB") from None


@click.command("export")
@click.argument("directory", metavar="DIR|MODEL", type=click.Path(file_okay=False))
@click.option("--to", "fmt", type=click.Choice(["hf", "onnx"]), required=True,
              help="hf: a Hugging Face folder (config.json, safetensors shards and index). "
                   "onnx: prefill.onnx and decode.onnx, the KV cache as explicit inputs and "
                   "outputs, for onnxruntime.")
@click.argument("out", type=click.Path())
@click.option("--dtype", type=click.Choice(["fp32", "bf16", "fp16"]), default="fp32",
              show_default=True, help="dtype of the written weights (hf).")
@click.option("--max-shard-size", default="5GB", show_default=True,
              help="Largest safetensors file (a bigger tensor gets its own file) (hf).")
@click.option("--merge", is_flag=True,
              help="LoRA fine-tuning: fold the adapters into the base weights and write the "
                   "whole model (default: peft's adapter folder) (hf).")
@click.option("--batch", type=int, default=None,
              help="onnx: rows per call, fixed in the programs  [default: 1]")
@click.option("--max-len", type=int, default=None,
              help="onnx: cache positions, prompt and new tokens together  [default: 128]")
@click.option("--prompt-len", type=int, default=None,
              help="onnx: prompt positions (shorter prompts are left-padded)  [default: 32]")
def export_cmd(directory: str, fmt: str, out: str, dtype: str, max_shard_size: str,
               merge: bool, batch: int | None, max_len: int | None,
               prompt_len: int | None) -> None:
    """Write the latest checkpoint of artifact DIR (trained under any plan) as a Hugging
    Face folder OUT: AutoModelForCausalLM.from_pretrained(OUT) loads it. A fine-tuning run
    becomes its adapter folder (LoRA and Prefix Tuning in peft's layout:
    PeftModel.from_pretrained(base, OUT)); a LoRA run with --merge the merged model.

    With --to onnx, write one process's cached generation as ONNX into OUT: prefill.onnx
    and decode.onnx, static shapes (--batch, --prompt-len, --max-len), the KV cache as
    explicit inputs and outputs, and generation.json. MODEL is also a shipped name or a
    Hugging Face folder. An artifact trained with tp, pp or ep > 1 is refused: export it
    --to hf first, then that folder --to onnx.

    \b
    Examples:
      autopar export autopar-tiny-llama-4 --to hf ./tiny-llama-trained
      autopar export DIR --to hf OUT --dtype bf16 --max-shard-size 2GB
      autopar export lora-run --to hf ./adapter          # adapter_model.safetensors + config
      autopar export lora-run --to hf ./merged --merge   # a whole model, LoRA folded in
      autopar export tiny-llama --to onnx ./onnx --batch 4 --prompt-len 64 --max-len 256
    """
    onnx_only = {"--batch": batch, "--max-len": max_len, "--prompt-len": prompt_len}
    if fmt == "onnx":
        hf_only = {"--dtype": dtype != "fp32", "--max-shard-size": max_shard_size != "5GB",
                   "--merge": merge}
        given = [name for name, set_ in hf_only.items() if set_]
        if given:
            raise PlanError(f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} for --to "
                            f"hf; drop {'it' if len(given) == 1 else 'them'} with --to onnx (the "
                            f"model exports as it loads, in its own dtype)")
        _export_onnx(directory, out, batch, max_len, prompt_len)
        return
    given = [name for name, value in onnx_only.items() if value is not None]
    if given:
        raise PlanError(f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} for --to "
                        f"onnx; drop {'it' if len(given) == 1 else 'them'} with --to hf")

    report = export_hf(directory, out, dtype=dtype, max_shard_bytes=_bytes(max_shard_size),
                       merge=merge)
    click.echo(f"exported step {report.step} of {directory} to {report.path}: {report.tensors} "
               f"tensors, {report.bytes / 2**20:.1f} MiB in {report.files} file"
               f"{'s' if report.files > 1 else ''} ({dtype})")
    if report.base is not None:
        copied = ", ".join(report.tokenizer_files) or "none found there"
        click.echo(f"base model (the run's --init-from): {report.base}; tokenizer files "
                   f"copied: {copied}")


def _export_onnx(model: str, out: str, batch: int | None, max_len: int | None,
                 prompt_len: int | None) -> None:
    from autopar.serve.onnx_decode import export_onnx

    sizes = {k: v for k, v in (("batch", batch), ("max_len", max_len),
                               ("prompt_len", prompt_len)) if v is not None}
    with progress(f"exporting {model} to ONNX"):
        report = export_onnx(model, out, **sizes)
    click.echo(f"exported {model} to {report.path}: prefill.onnx and decode.onnx, batch "
               f"{report.batch}, prompt {report.prompt_len}, cache {report.max_len} positions x "
               f"{report.layers} layers, {report.bytes / 2**20:.1f} MiB "
               f"({report.seconds:.1f} s)")
