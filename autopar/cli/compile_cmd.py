"""``autopar compile MODEL --devices N``: capture, search, print the report, write the plan."""

from __future__ import annotations

import json
from pathlib import Path

import click

from autopar.cli.plan_options import capture_for_plan, plan_options, search_progress
from autopar.codegen import compile_artifact
from autopar.codegen.artifact import edited_file
from autopar.errors import SequenceParallelUnsupported
from autopar.plan.launch import on_each_node, plan_launch
from autopar.search.api import plan as make_plan
from autopar.search.constraints import load_constraints


def _default_out(model: str, devices: int) -> Path:
    stem = Path(model.split(":")[-1]).stem if ("/" in model or model.endswith(".json")) \
        else model.replace(":", "-")
    return Path(f"autopar-{stem}-{devices}")


@click.command("compile", short_help="Plan MODEL on N devices, print the report, write the artifact.")
@click.argument("model")
@click.option("--devices", required=True, type=click.IntRange(min=1), help="Total devices.")
@plan_options
@click.option("--out", type=click.Path(file_okay=False), default=None,
              help="Artifact directory [default: ./autopar-MODEL-DEVICES].")
@click.option("--emit", type=click.Choice(["deepspeed", "megatron", "mindformers"]),
              multiple=True, help="Also write the plan in another engine's format "
                                  "(deepspeed.json, megatron.sh, mindformers.yaml).")
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text",
              show_default=True)
@click.option("--quiet", "-q", is_flag=True, help="No progress output.")
def compile_cmd(model: str, devices: int, cluster: str, task: str, global_batch: int | None,
                seq: int | None, constraints: tuple[str, ...], peft: str | None,
                max_token_latency_ms: float | None, memory_limit_gb: float | None, time_limit_s: float | None, out: str | None,
                emit: tuple[str, ...], fmt: str, quiet: bool) -> None:
    """Plan MODEL on DEVICES devices, print the strategy report and write the artifact DIR:
    plan.yaml, manifest.json and train.py, the training program generated from the plan
    (`autopar run DIR` and `torchrun DIR/train.py` run it). With --task infer, generate.py
    instead: the generation program (`autopar run DIR --generate --prompts FILE` serves it).

    MODEL is a shipped config name (autopar inspect --list), a Hugging Face config.json or its
    folder, a Python module:factory, or an .onnx file. Read the result again with
    `autopar report DIR`, question it with `autopar explain DIR`, compare two with
    `autopar diff DIR_A DIR_B`.

    \b
    Examples:
      autopar compile llama3-8b --devices 64 --global-batch 512
      autopar compile llama3-8b --devices 64 --global-batch 512 --constraints tp=8 \\
          --out llama3-8b-tp8          # pin one choice; then autopar diff the two
      autopar compile llama3-70b --devices 512 --cluster h100-80g --constraints megatron-3d
      autopar compile mixtral-8x7b --devices 64 --constraints tp=2,ep=8 --out mixtral-plan
      autopar compile llama3-8b --devices 64 --emit deepspeed   # also DIR/deepspeed.json
      autopar compile llama3-8b --devices 64 --constraints ds_config.json  # pins from it
      autopar compile llama2-70b --devices 64 --constraints mindformers.yaml \\
          --constraints engine=megatron --emit megatron      # a MindFormers job, for Megatron
      autopar compile tiny-llama --devices 4 --cluster ./profile.yaml --task infer
      autopar compile llama3-70b --devices 8 --cluster h100-80g --task infer \\
          --global-batch 32 --seq 4096          # 32 concurrent 4k-token sequences
      autopar compile llama3-8b --devices 8 --task infer --global-batch 256 \\
          --max-token-latency-ms 20             # the most tokens/s within 20 ms a token
      autopar compile llama3-8b --devices 8 --task finetune --peft lora   # LoRA, base frozen
      autopar compile llama3-8b --devices 8 --task finetune \\
          --peft method=lora,r=16,lora_alpha=32,target_modules=all-linear
    """
    graph, constraints = capture_for_plan(model, cluster=cluster, task=task, seq=seq,
                                          constraints=constraints, peft=peft,
                                          max_token_latency_ms=max_token_latency_ms,
                                          quiet=quiet)

    def search(pins: list[str] | None):
        with search_progress(quiet) as progress:
            return make_plan(graph, devices=devices, cluster=cluster, task=task,
                             global_batch=global_batch, constraints=pins,
                             memory_limit_gb=memory_limit_gb, time_limit_s=time_limit_s,
                             progress=progress, max_token_latency_ms=max_token_latency_ms)

    result = search(constraints)
    out_dir = Path(out) if out else _default_out(model, devices)
    if model.lower().endswith(".onnx"):  # planned, but an ONNX file cannot be trained
        out_dir.mkdir(parents=True, exist_ok=True)
        path = result.save(out_dir / "plan.yaml")
    else:
        try:
            path = compile_artifact(model, None, result, out_dir, emit=emit) / "plan.yaml"
        except SequenceParallelUnsupported as exc:
            if "sequence_parallel" in load_constraints(constraints):
                raise  # the user asked for it: say why it cannot run
            # the search prices sequence parallelism from the graph; the runtime cannot lay it
            # out over these modules, so the plan is searched again without it
            click.echo(f"autopar: {exc.args[0].split('; re-plan')[0]}; planning without "
                       f"sequence parallelism", err=True)
            result = search([*(constraints or []), "sequence_parallel=false"])
            path = compile_artifact(model, None, result, out_dir, emit=emit) / "plan.yaml"

        for name in ("train.py", "generate.py"):
            edited = out_dir / edited_file(name)  # only ever there when this compile kept one
            if edited.is_file():
                click.echo(f"autopar: your edited {name} is kept as {edited}", err=True)
    if fmt == "json":
        click.echo(json.dumps({**result.to_dict(), "plan_file": str(path)}, indent=2))
    else:
        click.echo(result.report(), nl=False)
        click.echo(f"\nwrote {path}")
        if not quiet:
            launch = plan_launch(result.devices, result.cluster)
            first = (f"{launch} {out_dir}/generate.py --prompts FILE",
                     "serve it (the generated program)") if result.task == "infer" else \
                (f"{launch} {out_dir}/train.py", "train it (the generated program)")
            if on_each_node(launch):
                first = (first[0], f"{first[1]}; {on_each_node(launch)}")
            hints = [first,
                     (f"autopar report {out_dir} --out report.html", "the report with plots"),
                     (f"autopar explain {out_dir} --block K", "why this sharding"),
                     (f"autopar diff {out_dir} OTHER_PLAN", "compare two plans")]
            width = max(len(c) for c, _ in hints)
            for i, (command, what) in enumerate(hints):
                click.echo(f"{'next:' if i == 0 else '':<6}{command:<{width}}   # {what}")
