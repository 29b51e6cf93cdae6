"""``autopar sweep MODEL --devices 8..1024``: the best plan per device budget, from one capture,
and where its shape changes; text, markdown, self-contained HTML or JSON."""

from __future__ import annotations

import time

import click

from autopar.cli.common import check_output_path, output_format, write_output
from autopar.cli.plan_options import capture_for_plan, plan_options, search_progress
from autopar.errors import InfeasibleError, PlanError
from autopar.report.sweep import render_sweep, short_reason
from autopar.search.sweep import devices_range, sweep

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


@click.command("sweep", short_help="The best plan per device budget, and where its shape "
                                   "changes.")
@click.argument("model")
@click.option("--devices", "budgets", required=True, callback=parse_budgets,
              metavar="N,N,..|A..B",
              help="Device budgets: a comma list (8,16,64) or a doubling range (8..1024 is "
                   "8, 16, ..., 1024), or both (1,2,8..64).")
@plan_options
@click.option("--format", "fmt", type=click.Choice(FORMATS), default=None,
              help="Output format [default: from --out's suffix (.html, .md, .json), else "
                   "text].")
@click.option("--out", default=None, type=click.Path(dir_okay=False),
              help="Write to this file (atomically) instead of stdout.")
@click.option("--quiet", "-q", is_flag=True, help="No progress, timing or 'wrote' lines on "
                                                  "stderr.")
def sweep_cmd(model: str, budgets: list[int], cluster: str, task: str,
              global_batch: int | None, seq: int | None, constraints: tuple[str, ...],
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

    \b
    Examples:
      autopar sweep llama3-8b --devices 8..1024                 # the table, to the terminal
      autopar sweep llama3-8b --devices 8..1024 --global-batch 1024 --out sweep.html
      autopar sweep llama3-70b --devices 8,16,32,64 --cluster h100-80g --format markdown
      autopar sweep mixtral-8x7b --devices 8..256 --constraints tp=2 --out sweep.json
      autopar sweep llama3-8b --devices 1..8 --task infer --global-batch 64 --seq 4096
    """
    fmt = output_format(fmt, out, FORMATS)
    if out:
        check_output_path(out)  # before the capture, so a bad path fails in milliseconds
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
