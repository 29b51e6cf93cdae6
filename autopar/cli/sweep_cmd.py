"""``autopar sweep MODEL --devices 8..1024``: the best plan per device budget, from one capture,
and where its shape changes; ``--devices 64 --seq 8k..1M``: the best plan per sequence length
(one capture per length); text, markdown, self-contained HTML or JSON."""

from __future__ import annotations

import time

import click

from autopar.cli.common import capture_model, check_output_path, output_format, write_output
from autopar.cli.plan_options import (
    capture_for_plan,
    check_plan_inputs,
    plan_options_but_seq,
    search_progress,
)
from autopar.errors import InfeasibleError, PlanError
from autopar.models.spec import is_factory
from autopar.report.sweep import render_sweep, short_reason
from autopar.search.sweep import devices_range, sweep, sweep_seq, tokens_range

FORMATS = ("text", "markdown", "html", "json")


def parse_budgets(ctx: click.Context | None, param: click.Parameter | None,
                  value: str) -> list[int]:
    """``8,16,64`` or ``8..1024`` (8, 16, 32, ... 1024: doubling), or both comma-joined;
    ascending, without repeats."""
    budgets: set[int] = set()
    for item in value.split(","):
        item = item.strip()
        try:
            if ".." in item:
                first, last = item.split("..", 1)
                budgets.update(devices_range(int(first), int(last)))
                continue
            n = int(item)
        except ValueError:
            raise click.BadParameter(f"{item!r} is not a device count: give positive integers "
                                     f"(8,16,64) or a doubling range (8..1024)") from None
        except PlanError as exc:
            raise click.BadParameter(str(exc)) from None
        if n < 1:
            raise click.BadParameter(f"{n} devices: a budget is at least 1 device")
        budgets.add(n)
    return sorted(budgets)


_TOKEN_UNITS = {"k": 1024, "m": 1024 * 1024}


def parse_length(item: str) -> int:
    """``8192``, ``8k`` (8 x 1024) or ``1M`` (1024 x 1024) tokens."""
    text = item.strip().lower()
    scale = _TOKEN_UNITS.get(text[-1:], 1)
    digits = text[:-1] if scale > 1 else text
    if not digits.isdigit() or int(digits) < 1:
        raise click.BadParameter(f"{item!r} is not a sequence length: give tokens (8192), or "
                                 f"k / M multiples of 1024 (8k, 1M)")
    return int(digits) * scale


def parse_seqs(ctx: click.Context | None, param: click.Parameter | None,
               value: str | None) -> list[int] | None:
    """``4096``, ``8k,32k`` or ``8k..1M`` (8k, 16k, ..., 1M: doubling), or both
    comma-joined; ascending, without repeats. None when not given."""
    if value is None:
        return None
    lengths: set[int] = set()
    for item in value.split(","):
        if ".." in item:
            first, last = item.split("..", 1)
            try:
                lengths.update(tokens_range(parse_length(first), parse_length(last)))
            except PlanError as exc:
                raise click.BadParameter(str(exc)) from None
        else:
            lengths.add(parse_length(item))
    return sorted(lengths)


@click.command("sweep", short_help="The best plan per device budget, and where its shape "
                                   "changes.")
@click.argument("model")
@click.option("--devices", "budgets", required=True, callback=parse_budgets,
              metavar="N,N,..|A..B",
              help="Device budgets: a comma list (8,16,64) or a doubling range (8..1024 is "
                   "8, 16, ..., 1024), or both (1,2,8..64).")
@click.option("--seq", "seqs", default=None, callback=parse_seqs, metavar="L,L,..|A..B",
              help="Tokens per sequence: one length, a comma list (8k,32k) or a doubling range "
                   "(8k..1M is 8k, 16k, ..., 1M; 8192, 8k and 1M forms) to sweep sequence "
                   "lengths on one --devices budget [default: the constraints' model "
                   "seq_length, else the config's context, at most 4096].")
@plan_options_but_seq
@click.option("--format", "fmt", type=click.Choice(FORMATS), default=None,
              help="Output format [default: from --out's suffix (.html, .md, .json), else "
                   "text].")
@click.option("--out", default=None, type=click.Path(dir_okay=False),
              help="Write to this file (atomically) instead of stdout.")
@click.option("--quiet", "-q", is_flag=True, help="No progress, timing or 'wrote' lines on "
                                                  "stderr.")
def sweep_cmd(model: str, budgets: list[int], cluster: str, task: str,
              global_batch: int | None, seqs: list[int] | None, constraints: tuple[str, ...],
              peft: str | None, max_token_latency_ms: float | None,
              memory_limit_gb: float | None, time_limit_s: float | None, fmt: str | None,
              out: str | None, quiet: bool) -> None:
    """Capture MODEL once and plan it for each device budget: print (or draw, with --out
    FILE.html) how the best plan and its predicted step time, tokens/s, MFU and memory per
    device change with the budget, and mark where the plan's shape changes (pp, tp, ep,
    ZeRO stage, schedule, micro-batch size, recompute, offload, sequence parallelism).

    Each row is exactly the plan `autopar compile MODEL --devices N` (same options) would
    choose. A budget without a plan is a row with the reason; when no budget has one, the
    exit code is 2. Without --global-batch each budget gets compile's default (what the
    constraints imply, else one sequence per device); a global batch that the budget's
    data-parallel degree cannot split is noted in its row, and refused there if no mesh
    divides it. MODEL is what `autopar compile` takes.

    With several --seq lengths and one --devices budget, each row is one sequence length
    instead (the model captured once per length), and the changes column marks where the
    mesh, context parallelism (cp and its mode), recompute or another shape field changes.

    \b
    Examples:
      autopar sweep llama3-8b --devices 8..1024                 # the table, to the terminal
      autopar sweep llama3-8b --devices 8..1024 --global-batch 1024 --out sweep.html
      autopar sweep llama3-70b --devices 8,16,32,64 --cluster h100-80g --format markdown
      autopar sweep mixtral-8x7b --devices 8..256 --constraints tp=2 --out sweep.json
      autopar sweep llama3-8b --devices 1..8 --task infer --global-batch 64 --seq 4096
      autopar sweep llama3-8b --devices 64 --cluster h100-80g --seq 8k..128k
    """
    fmt = output_format(fmt, out, FORMATS)
    if out:
        check_output_path(out)  # before the capture, so a bad path fails in milliseconds
    if seqs is not None and len(seqs) > 1:
        if len(budgets) > 1:
            raise click.BadParameter("sweep one axis at a time: one --devices budget with "
                                     "several --seq lengths, or one --seq with several "
                                     "budgets", param_hint="'--seq'")
        rows = _sweep_lengths(model, budgets[0], seqs, cluster=cluster, task=task,
                              global_batch=global_batch, constraints=constraints, peft=peft,
                              max_token_latency_ms=max_token_latency_ms,
                              memory_limit_gb=memory_limit_gb, time_limit_s=time_limit_s,
                              quiet=quiet)
        write_output(render_sweep(rows, fmt), out, quiet)
        return
    seq = seqs[0] if seqs else None
    started = time.perf_counter()
    graph, constraints = capture_for_plan(model, cluster=cluster, task=task, seq=seq,
                                          constraints=constraints, peft=peft,
                                          max_token_latency_ms=max_token_latency_ms,
                                          quiet=quiet)
    captured = time.perf_counter()
    with search_progress(quiet, "planning") as progress:
        rows = sweep(graph, budgets,
                     on_budget=(lambda n, i, k: progress(i / k, f"{n} devices"))
                     if progress else None,
                     cluster=cluster, task=task, global_batch=global_batch,
                     constraints=constraints, memory_limit_gb=memory_limit_gb,
                     time_limit_s=time_limit_s, max_token_latency_ms=max_token_latency_ms)
    planned = time.perf_counter()
    if not any(r.feasible for r in rows):
        last = rows[-1]
        raise InfeasibleError(f"no plan for any of the {len(rows)} budgets "
                              f"({', '.join(str(r.devices) for r in rows)} devices); at "
                              f"{last.devices}: {short_reason(last.reason or '')}")
    text = render_sweep(rows, fmt)
    if not quiet:
        click.echo(f"autopar: captured in {captured - started:.1f} s, planned {len(rows)} "
                   f"budgets in {planned - captured:.1f} s", err=True)
    write_output(text, out, quiet)


def _sweep_lengths(model: str, devices: int, seqs: list[int], *, cluster: str, task: str,
                   global_batch: int | None, constraints: tuple[str, ...], peft: str | None,
                   max_token_latency_ms: float | None, memory_limit_gb: float | None,
                   time_limit_s: float | None, quiet: bool) -> list:
    """The rows of a sweep over sequence lengths (one capture per length), with the fast
    checks run before the first capture; exit code 2 when no length has a plan."""
    if is_factory(model):
        raise click.BadParameter(f"{model} builds its own example inputs, whose length --seq "
                                 f"cannot change: sweep a shipped name or a config",
                                 param_hint="'--seq'")
    # pins, cluster, --peft and the latency bound fail here in milliseconds
    listed, _, peft_config = check_plan_inputs(cluster=cluster, task=task,
                                               constraints=constraints, peft=peft,
                                               max_token_latency_ms=max_token_latency_ms)
    started = time.perf_counter()
    with search_progress(quiet, "planning") as progress:
        rows = sweep_seq(model, seqs, devices=devices,
                         on_seq=(lambda n, i, k: progress(i / k, f"{n} tokens"))
                         if progress else None,
                         cluster=cluster, task=task, global_batch=global_batch,
                         constraints=listed, memory_limit_gb=memory_limit_gb,
                         time_limit_s=time_limit_s, max_token_latency_ms=max_token_latency_ms,
                         capture=lambda n: capture_model(model, 1, n, quiet, peft=peft_config))
    if not any(r.feasible for r in rows):
        last = rows[-1]
        raise InfeasibleError(f"no plan for any of the {len(rows)} sequence lengths on "
                              f"{devices} devices; at {last.seq} tokens: "
                              f"{short_reason(last.reason or '')}")
    if not quiet:
        click.echo(f"autopar: captured and planned {len(rows)} sequence lengths in "
                   f"{time.perf_counter() - started:.1f} s", err=True)
    return rows
