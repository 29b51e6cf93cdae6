"""``autopar run DIR``: train an artifact under torchrun (or as one process) through the
training package's launcher (:func:`autopar.train.launch.train_artifact`); ``--generate``
serves a generation artifact (compiled with ``--task infer``) from its generate.py."""

from __future__ import annotations

import click

from autopar.artifact import load_artifact
from autopar.errors import PlanError
from autopar.plan.support import refuse_unsupported
from autopar.serve.launch import serve_artifact
from autopar.train.launch import run_settings, train_artifact
from autopar.train.options import RunOptions
from autopar.train.run_flags import run_options


@click.command("run")
@run_options
def run_cmd(**params: object) -> None:
    """Train the artifact in DIRECTORY with its program (DIR/train.py): a console line per
    step (loss, learning rate, tokens/s, MFU, memory, ETA) and one JSON line per step in
    DIR/logs/train.jsonl (TensorBoard events in DIR/logs/tensorboard when tensorboard is
    installed); --eval adds validation loss and perplexity (DIR/logs/eval.jsonl); --profile a
    trace per rank and a per-stage summary (DIR/logs/profile). With --generate, serve a
    generation artifact (compiled with --task infer) with its program (DIR/generate.py): one
    JSON line per prompt with its new token ids on stdout, tokens/s on stderr.

    The program is regenerated when plan.yaml changed since it was written; once edited by
    hand it is run as it is.

    \b
    Examples:
      torchrun --nproc-per-node 4 -m autopar run autopar-tiny-llama-4 --steps 20 --device cpu
      torchrun --nproc-per-node 2 -m autopar run DIR --steps 10 --resume   # after re-planning
      torchrun --nnodes 2 --nproc-per-node 8 ... -m autopar run DIR --steps 1000
      torchrun --nproc-per-node 4 -m autopar run DIR --init-from ./Llama-3.2-1B
      torchrun --nproc-per-node 4 -m autopar run DIR --steps 1000 --lr 3e-4 \\
          --warmup-steps 100 --lr-schedule cosine --weight-decay 0.1 --betas 0.9,0.95
      torchrun --nproc-per-node 4 -m autopar run DIR --eval val --eval-every 100
      torchrun --nproc-per-node 4 -m autopar run DIR --steps 8 --profile   # then report --run
      autopar run SERVE_DIR --generate --prompts prompts.jsonl --max-new-tokens 64
      torchrun --nproc-per-node 2 -m autopar run SERVE_DIR --generate --prompts p.jsonl --sample
    """
    run(RunOptions.from_click(params))


def run(options: RunOptions) -> None:
    """``autopar run`` for parsed options: serve or train the artifact."""
    directory = options.directory
    manifest, plan = load_artifact(directory)
    refuse_unsupported(plan)  # before any program is (re)generated
    if options.serving or plan.task == "infer":
        serve_artifact(options, manifest, plan)
        return
    if options.generation.prompts is not None:
        raise PlanError(f"--prompts goes with --generate, which serves an artifact compiled "
                        f"with --task infer; {directory} trains (task {plan.task})")
    hyper, held, window = run_settings(options)  # bad settings fail before any process group
    train_artifact(options, manifest, plan, hyper=hyper, held=held, window=window)
