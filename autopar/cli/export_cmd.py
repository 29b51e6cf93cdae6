"""``autopar export DIR --to hf OUT``: the trained model as a Hugging Face folder."""

from __future__ import annotations

import click


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
@click.argument("directory", type=click.Path(file_okay=False))
@click.option("--to", "fmt", type=click.Choice(["hf"]), required=True,
              help="hf: a Hugging Face folder (config.json, safetensors shards and index).")
@click.argument("out", type=click.Path())
@click.option("--dtype", type=click.Choice(["fp32", "bf16", "fp16"]), default="fp32",
              show_default=True, help="dtype of the written weights.")
@click.option("--max-shard-size", default="5GB", show_default=True,
              help="Largest safetensors file (a bigger tensor gets its own file).")
@click.option("--merge", is_flag=True,
              help="LoRA fine-tuning: fold the adapters into the base weights and write the "
                   "whole model (default: peft's adapter folder).")
def export_cmd(directory: str, fmt: str, out: str, dtype: str, max_shard_size: str,
               merge: bool) -> None:
    """Write the latest checkpoint of artifact DIRECTORY (trained under any plan) as a
    Hugging Face folder OUT: AutoModelForCausalLM.from_pretrained(OUT) loads it. A
    fine-tuning run becomes its adapter folder (LoRA and Prefix Tuning in peft's layout:
    PeftModel.from_pretrained(base, OUT)); a LoRA run with --merge the merged model.

    \b
    Examples:
      autopar export autopar-tiny-llama-4 --to hf ./tiny-llama-trained
      autopar export DIR --to hf OUT --dtype bf16 --max-shard-size 2GB
      autopar export lora-run --to hf ./adapter          # adapter_model.safetensors + config
      autopar export lora-run --to hf ./merged --merge   # a whole model, LoRA folded in
    """
    from autopar.runtime.hf_export import export_hf

    report = export_hf(directory, out, dtype=dtype, max_shard_bytes=_bytes(max_shard_size),
                       merge=merge)
    click.echo(f"exported step {report.step} of {directory} to {report.path}: {report.tensors} "
               f"tensors, {report.bytes / 2**20:.1f} MiB in {report.files} file"
               f"{'s' if report.files > 1 else ''} ({dtype})")
