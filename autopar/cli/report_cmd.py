"""``autopar report PLAN``: the strategy report of a plan file, in text, markdown, HTML, JSON."""

from __future__ import annotations

import click

from autopar.cli.common import check_output_path, load_plan, output_format, progress, write_output
from autopar.errors import PlanError
from autopar.report import render
from autopar.report.run import load_run

FORMATS = ("text", "markdown", "html", "json")


@click.command("report", short_help="The strategy report of a plan: text, markdown, HTML, JSON.")
@click.argument("plan_path", metavar="PLAN")
@click.option("--format", "fmt", type=click.Choice(FORMATS), default=None,
              help="Output format [default: from --out's suffix (.html, .md, .json), else "
                   "text].")
@click.option("--out", default=None, type=click.Path(dir_okay=False),
              help="Write to this file (atomically) instead of stdout.")
@click.option("--run", "with_run", is_flag=True,
              help="PLAN is an artifact DIR that was run: add the run's outcome and, after "
                   "`autopar run --profile`, per stage and term the measured time next to "
                   "the predicted one and the error (HTML: the measured step beside the "
                   "predicted timeline, loss and throughput curves).")
@click.option("--quiet", "-q", is_flag=True, help="No progress or 'wrote' lines on stderr.")
def report_cmd(plan_path: str, fmt: str | None, out: str | None, with_run: bool,
               quiet: bool) -> None:
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
      autopar report DIR --run --out run.html   # after torchrun ... autopar run DIR --profile
    """
    fmt = output_format(fmt, out, FORMATS)
    if out:
        check_output_path(out)  # before the work, so a bad path fails fast
    plan = load_plan(plan_path)
    run = None
    if with_run:
        from pathlib import Path

        if not Path(plan_path).is_dir():
            raise PlanError(f"--run reads a run's logs from its artifact directory; pass the "
                            f"DIR that autopar compile wrote and autopar run trained, not "
                            f"{plan_path}")
        run = load_run(plan_path)
    with progress("drawing the report", quiet or fmt != "html"):
        text = render(plan, fmt, run)
    write_output(text, out, quiet)
