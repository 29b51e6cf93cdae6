"""``autopar report PLAN``: the strategy report of a plan file, in text, markdown, HTML, JSON."""

from __future__ import annotations

import click

from autopar.cli.common import check_output_path, load_plan, output_format, progress, write_output

FORMATS = ("text", "markdown", "html", "json")


@click.command("report", short_help="The strategy report of a plan: text, markdown, HTML, JSON.")
@click.argument("plan_path", metavar="PLAN")
@click.option("--format", "fmt", type=click.Choice(FORMATS), default=None,
              help="Output format [default: from --out's suffix (.html, .md, .json), else "
                   "text].")
@click.option("--out", default=None, type=click.Path(dir_okay=False),
              help="Write to this file (atomically) instead of stdout.")
@click.option("--quiet", "-q", is_flag=True, help="No progress or 'wrote' lines on stderr.")
def report_cmd(plan_path: str, fmt: str | None, out: str | None, quiet: bool) -> None:
    """Print the strategy report of PLAN (a plan.yaml, or the artifact directory of
    `autopar compile`): mesh, schedule, batching, ZeRO, recompute, offload; predicted step
    time, tokens/s, MFU and memory against the budget; per-stage time and memory; the
    runner-up plans, the binding bounds and the solver's proven gap.

    The HTML report is one self-contained file (no network) with a pipeline timeline of one
    step, memory per stage against the budget and a time breakdown. Everything is read from
    the plan file: nothing is recaptured.

    \b
    Examples:
      autopar report autopar-llama3-8b-64                 # text, to the terminal
      autopar report autopar-llama3-8b-64 --out report.html   # format from the suffix
      autopar report plan.yaml --format markdown > PLAN.md
      autopar report plan.yaml --format json | jq .summary.step_time_s
    """
    fmt = output_format(fmt, out, FORMATS)
    if out:
        check_output_path(out)  # before the work, so a bad path fails fast
    plan = load_plan(plan_path)
    with progress("drawing the report", quiet or fmt != "html"):
        text = plan.report(fmt)
    write_output(text, out, quiet)
