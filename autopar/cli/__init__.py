"""The ``autopar`` command line. Exit codes: 0 done, 2 bad input or infeasible, 1 internal error."""

from __future__ import annotations

import sys

import click

from autopar.cli.compile_cmd import compile_cmd
from autopar.cli.data_cmd import data_group
from autopar.cli.diff_cmd import diff_cmd
from autopar.cli.explain_cmd import explain_cmd
from autopar.cli.export_cmd import export_cmd
from autopar.cli.generate_cmd import generate_cmd
from autopar.cli.inspect_cmd import inspect_cmd
from autopar.cli.profile_cmd import profile_cmd
from autopar.cli.report_cmd import report_cmd
from autopar.cli.run_cmd import run_cmd
from autopar.cli.sweep_cmd import sweep_cmd
from autopar.cli.train_cmd import eval_cmd, finetune_cmd, init_cmd, predict_cmd, train_cmd
from autopar.errors import AutoparError
from autopar.train.launch import end_process, fail_message


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="autopar")
def cli() -> None:
    """autopar: plan, build and run a PyTorch model across many devices.

    \b
    Examples:
      autopar compile llama3-8b --devices 64 --global-batch 512   # plan it, print the report
      autopar sweep llama3-8b --devices 8..1024 --out sweep.html  # best plan per budget
      autopar report autopar-llama3-8b-64 --out report.html       # report with plots
      autopar explain autopar-llama3-8b-64 --block model.layers.3 # why this sharding
      autopar diff autopar-llama3-8b-64 other-plan                # what changed, its effect
      autopar inspect llama3-8b              # capture a shipped config, print its structure
      autopar inspect ./my-model/config.json --seq 2048
      autopar inspect model.onnx
      autopar profile --quick --out my-box.yaml    # measure this machine, use cluster=my-box.yaml
      autopar data prepare corpus.txt --out tok    # token dataset for `run --data tok`
      torchrun --nproc-per-node 2 -m autopar run autopar-tiny-llama-2   # train a plan
      autopar run DIR --init-from ./hf-folder     # start from Hugging Face weights
      autopar export DIR --to hf ./trained        # the trained model as a Hugging Face folder
      autopar generate DIR --prompts p.jsonl      # generate with a KV cache, print tokens/s
    """


cli.add_command(inspect_cmd)
cli.add_command(compile_cmd)
cli.add_command(sweep_cmd)
cli.add_command(report_cmd)
cli.add_command(diff_cmd)
cli.add_command(explain_cmd)
# one line in `autopar --help` (the docstring's first sentence is long)
run_cmd.short_help = "Train an artifact DIR under torchrun (or as one process)."
cli.add_command(run_cmd)
cli.add_command(profile_cmd)
cli.add_command(export_cmd)
cli.add_command(generate_cmd)
cli.add_command(data_group)
# a run described by one YAML file (autopar's run config, or a MindFormers run YAML)
for _command in (init_cmd, train_cmd, finetune_cmd, eval_cmd, predict_cmd):
    cli.add_command(_command)


def main(argv: list[str] | None = None) -> None:
    """Console entry point: one line on stderr and exit code 2 for any input problem."""
    try:
        code = cli.main(args=argv, prog_name="autopar", standalone_mode=False)
    except click.exceptions.Exit as exc:
        code = exc.exit_code
    except click.UsageError as exc:
        print(fail_message(exc.format_message(), exc.ctx), file=sys.stderr)
        code = 2
    except click.ClickException as exc:
        print(fail_message(exc.format_message(), None), file=sys.stderr)
        code = 2
    except click.Abort:
        print("autopar: interrupted", file=sys.stderr)
        code = 130
    except AutoparError as exc:
        print(fail_message(str(exc), None), file=sys.stderr)
        code = getattr(exc, "exit_code", 2)
    end_process(code or 0)
