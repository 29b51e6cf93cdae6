"""``autopar diff PLAN_A PLAN_B``: what changed between two plans and its predicted effect."""

from __future__ import annotations

import click

from autopar.cli.common import check_output_path, load_plan, output_format, write_output
from autopar.report.diff import plan_diff, render_diff

FORMATS = ("text", "markdown", "json")


@click.command("diff", short_help="Two plans side by side: what changed, its predicted effect.")
@click.argument("plan_a", metavar="PLAN_A")
@click.argument("plan_b", metavar="PLAN_B")
@click.option("--format", "fmt", type=click.Choice(FORMATS), default=None,
              help="Output format [default: from --out's suffix, else text].")
@click.option("--out", default=None, type=click.Path(dir_okay=False),
              help="Write to this file (atomically) instead of stdout.")
@click.option("--quiet", "-q", is_flag=True, help="No 'wrote' line on stderr.")
def diff_cmd(plan_a: str, plan_b: str, fmt: str | None, out: str | None, quiet: bool) -> None:
    """Compare two plans (plan files or artifact directories): the decisions that differ
    (mesh, batching, ZeRO, schedule, recompute, offload, stages, parameter placements,
    constraints) and the predicted effect on step time, throughput, MFU and memory, with
    the step-time terms that moved.

    \b
    Examples:
      autopar diff autopar-llama3-8b-64 llama3-8b-pp2
      autopar diff a/plan.yaml b/plan.yaml --format markdown --out CHANGES.md
      autopar diff a/plan.yaml b/plan.yaml --format json
    """
    fmt = output_format(fmt, out, FORMATS)
    if out:
        check_output_path(out)
    a, b = load_plan(plan_a), load_plan(plan_b)
    write_output(render_diff(plan_diff(a, b), plan_a, plan_b, fmt), out, quiet)
