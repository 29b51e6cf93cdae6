"""The planning options ``autopar compile`` and ``autopar sweep`` share, and the checks and
capture both run before planning."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator

import click

from autopar.cli.common import capture_model
from autopar.cost.hardware import load_cluster
from autopar.errors import PlanError
from autopar.peft import parse_peft
from autopar.search.constraints import load_constraints

_SEQ_OPTION = click.option(
    "--seq", type=click.IntRange(min=1), default=None,
    help="Tokens per sequence [default: the constraints' model seq_length, else the config's "
         "context, at most 4096].")
_OPTIONS = [
    click.option("--cluster", default="a100-80g", show_default=True,
                 help="A cost_models/ name or a profile YAML from `autopar profile`."),
    click.option("--task", type=click.Choice(["train", "finetune", "infer"]), default="train",
                 show_default=True),
    click.option("--global-batch", type=click.IntRange(min=1), default=None,
                 help="Sequences per optimizer step (infer: concurrent sequences) "
                      "[default: what the constraints imply, else one per device]."),
    _SEQ_OPTION,
    click.option("--constraints", default=None, multiple=True,
                 help="A YAML file (MindFormers YAML, DeepSpeed JSON and Megatron-LM arguments "
                      "are recognised by content), a strategies/ preset (megatron-3d, "
                      "zero3-only, data-parallel-only, mindformers-style) or k=v,k=v pins "
                      "(tp=8,pp=2); repeat it to combine, later pins winning."),
    click.option("--peft", default=None,
                 help="With --task finetune: a parameter-efficient method (lora, prefix_tuning, "
                      "adapter, low_rank_adapter, bitfit, rdrop), k=v settings "
                      "(method=lora,r=16,lora_alpha=32,target_modules=all-linear) or peft's "
                      "adapter_config.json."),
    click.option("--max-token-latency-ms", type=float, default=None,
                 help="With --task infer: the longest decoding step allowed; the plan then "
                      "takes the concurrency (up to --global-batch) with the most tokens/s "
                      "within it."),
    click.option("--memory-limit-gb", type=float, default=None,
                 help="Usable memory per device [default: the cluster's]."),
    click.option("--time-limit", "time_limit_s", type=click.FloatRange(min=0), default=None,
                 help="Stop the search after this many seconds and report the proven gap."),
]


def plan_options(command: Callable) -> Callable:
    """Add the shared planning options (``--cluster`` .. ``--time-limit``) to ``command``."""
    for option in reversed(_OPTIONS):
        command = option(command)
    return command


def plan_options_but_seq(command: Callable) -> Callable:
    """:func:`plan_options` without ``--seq``, for a command that takes it its own way
    (``autopar sweep``: a list or range of lengths)."""
    for option in reversed(_OPTIONS):
        if option is not _SEQ_OPTION:
            command = option(command)
    return command


def capture_for_plan(model: str, *, cluster: str, task: str, seq: int | None,
                     constraints: tuple[str, ...], peft: str | None,
                     max_token_latency_ms: float | None, quiet: bool):
    """Check what fails in milliseconds (pins, cluster, ``--peft``, the latency bound) before
    the seconds to minutes of capture, then capture MODEL once. Returns the graph and the
    constraints as ``autopar.plan`` takes them (a list, or None when none were given)."""
    listed, pins, peft_config = check_plan_inputs(
        cluster=cluster, task=task, constraints=constraints, peft=peft,
        max_token_latency_ms=max_token_latency_ms)
    seq = seq or (pins.get("model") or {}).get("seq_length")
    return capture_model(model, 1, seq, quiet, peft=peft_config), listed


def check_plan_inputs(*, cluster: str, task: str, constraints: tuple[str, ...],
                      peft: str | None, max_token_latency_ms: float | None
                      ) -> tuple[list | None, dict, object]:
    """The checks :func:`capture_for_plan` runs before capture: (the constraints as
    ``autopar.plan`` takes them, their pins, the parsed ``--peft`` or None)."""
    listed = list(constraints) or None
    pins = load_constraints(listed)
    load_cluster(cluster)
    peft_config = None
    if peft is not None:
        if task != "finetune":
            raise PlanError(f"--peft trains part of the model: add --task finetune (not "
                            f"--task {task})")
        peft_config = parse_peft(peft)
    if max_token_latency_ms is not None and task != "infer":
        raise PlanError(f"--max-token-latency-ms bounds a serving plan's decoding step: add "
                        f"--task infer (not --task {task})")
    return listed, pins, peft_config


@contextlib.contextmanager
def search_progress(quiet: bool, label: str = "searching") -> Iterator[object]:
    """A progress bar on stderr for the search (silent when quiet or not a terminal); yields
    the ``progress(fraction, message)`` callback ``autopar.plan`` takes, or None."""
    if quiet or not sys.stderr.isatty():
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn(label), BarColumn(), TextColumn("{task.description}"),
                  TimeElapsedColumn(), console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("", total=1.0)
        yield lambda fraction, message: bar.update(task, completed=fraction,
                                                   description=message)
