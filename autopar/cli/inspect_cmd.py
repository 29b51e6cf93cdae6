"""``autopar inspect MODEL``: capture a model and summarise its graph."""

from __future__ import annotations

import json

import click

from autopar.cli.common import capture_model
from autopar.ir.summary import summary_dict, summary_text
from autopar.models import list_models as names


@click.command("inspect", short_help="Capture MODEL; print parameters, FLOPs, blocks, big tensors.")
@click.argument("model", default="llama3-8b", required=False)
@click.option("--batch", default=1, show_default=True, type=click.IntRange(min=1),
              help="Sequences in the example input.")
@click.option("--seq", default=None, type=click.IntRange(min=1),
              help="Tokens per sequence [default: the config's context, at most 4096].")
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text",
              show_default=True)
@click.option("--quiet", "-q", is_flag=True, help="No progress output.")
@click.option("--list", "list_models", is_flag=True, help="List the shipped model configs and exit.")
def inspect_cmd(model: str, batch: int, seq: int | None, fmt: str, quiet: bool,
                list_models: bool) -> None:
    """Capture MODEL and print parameters, FLOPs per token, blocks and largest tensors.

    MODEL is a shipped config name (llama3-8b, mixtral-8x7b, tiny-llama, ...; see
    `autopar inspect --list`), a Hugging Face config.json or its folder, a Python
    `module:factory` returning a model or (model, example_inputs), or an .onnx file.
    Nothing is downloaded: Hugging Face models are built from their config on the meta device.

    \b
    Examples:
      autopar inspect llama3-70b --seq 4096
      autopar inspect tiny-mixtral --format json
      autopar inspect mypkg.models:make_model
    """
    if list_models:
        click.echo("\n".join(names()))
        return
    graph = capture_model(model, batch, seq, quiet)
    if fmt == "json":
        click.echo(json.dumps(summary_dict(graph), indent=2))
    else:
        click.echo(summary_text(graph, title=model))
