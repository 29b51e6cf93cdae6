"""``autopar run``'s training options: the optimizer and schedule, evaluation, profiling and
the console, parsed into the runtime's settings."""

from __future__ import annotations

from collections.abc import Callable

import click

from autopar.errors import PlanError
from autopar.train.optim import DECAYS, Hyperparameters

BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}  # the collective backend of each device type


def _betas(ctx, param, value: str) -> tuple[float, float]:
    try:
        b1, b2 = (float(v) for v in value.split(","))
    except ValueError:
        raise click.BadParameter(f"'{value}' is not two numbers like 0.9,0.95") from None
    return b1, b2


def _steps_range(ctx, param, value: str | None) -> tuple[int, int] | None:
    if value is None:
        return None
    try:
        start, end = (int(v) for v in value.split(":"))
    except ValueError:
        raise click.BadParameter(f"'{value}' is not START:END like 2:4") from None
    if start < 0 or end <= start:
        raise click.BadParameter(f"'{value}' needs 0 <= START < END (steps START..END-1 are "
                                 f"recorded)")
    return start, end


_OPTIONS: list[Callable] = [
    click.option("--lr", default=1e-3, show_default=True, type=float,
                 help="Peak learning rate."),
    click.option("--lr-schedule", "decay", type=click.Choice(DECAYS), default="constant",
                 show_default=True, help="Decay after the warm-up."),
    click.option("--warmup-steps", default=0, show_default=True, type=click.IntRange(min=0),
                 help="Linear warm-up steps."),
    click.option("--decay-steps", default=None, type=click.IntRange(min=1),
                 help="The schedule's horizon, warm-up included [default: this run's last "
                      "step, or a resumed run's horizon]."),
    click.option("--min-lr", default=0.0, show_default=True, type=float,
                 help="Learning rate at the end of the decay."),
    click.option("--weight-decay", default=0.01, show_default=True, type=float,
                 help="AdamW weight decay of weights with 2+ dimensions (biases and norms: "
                      "none)."),
    click.option("--betas", default="0.9,0.999", show_default=True, callback=_betas,
                 help="AdamW's beta1,beta2."),
    click.option("--eps", default=1e-8, show_default=True, type=float, help="AdamW's eps."),
    click.option("--grad-clip", default=1.0, show_default=True, type=float,
                 help="Clip the global gradient norm to this (0: no clipping)."),
    click.option("--router-aux-loss", "router_aux_coef", default=None, type=float,
                 help="Weight of a mixture of experts' load-balancing loss (0: off) [default: "
                      "the model config's router_aux_loss_coef if its output_router_logits "
                      "is set, else off]."),
    click.option("--router-z-loss", "router_z_coef", default=0.0, show_default=True,
                 type=float, help="Weight of the router z-loss (ST-MoE)."),
    click.option("--capacity-factor", default=None, type=float,
                 help="Cap each expert at this factor times an even share of a sequence's "
                      "token copies, dropping the rest (GShard) [default: dropless]."),
    click.option("--no-document-mask", "document_mask", is_flag=True, default=True,
                 flag_value=False,
                 help="Let packed documents attend to each other (by default positions "
                      "restart after each end-of-document token where the model allows)."),
    click.option("--eval", "eval_source", default=None,
                 help="Held-out data for validation loss and perplexity: 'synthetic' or a "
                      "token dataset PREFIX; logged to DIR/logs/eval.jsonl."),
    click.option("--eval-every", default=0, show_default=True, type=click.IntRange(min=0),
                 help="With --eval: evaluate every N steps (and always at the end)."),
    click.option("--eval-batches", default=2, show_default=True, type=click.IntRange(min=1),
                 help="With --eval: held-out global batches per evaluation."),
    click.option("--profile", "profile", is_flag=True,
                 help="Record a torch.profiler trace per rank (DIR/logs/profile/, opens in "
                      "Perfetto) and a per-stage summary of where the step went."),
    click.option("--profile-steps", default=None, callback=_steps_range,
                 help="With --profile: steps START:END of this run [default: the last "
                      "min(3, steps - 1) steps, after a warm-up step]."),
    click.option("--log-every", default=1, show_default=True, type=click.IntRange(min=1),
                 help="Print the console line every N steps (off a terminal)."),
    click.option("--quiet", "-q", is_flag=True, help="No per-step console line."),
]


def training_options(command: Callable) -> Callable:
    """Add the training options to a click command."""
    for option in reversed(_OPTIONS):
        command = option(command)
    return command


def hyperparameters(options: dict) -> Hyperparameters:
    """The runtime's settings from the parsed options (a bad combination is a PlanError)."""
    return Hyperparameters(lr=options["lr"], warmup_steps=options["warmup_steps"],
                           decay=options["decay"], decay_steps=options["decay_steps"],
                           min_lr=options["min_lr"], weight_decay=options["weight_decay"],
                           betas=options["betas"], eps=options["eps"],
                           grad_clip=options["grad_clip"],
                           router_aux_coef=options.get("router_aux_coef"),
                           router_z_coef=options.get("router_z_coef", 0.0),
                           capacity_factor=options.get("capacity_factor"))


def profile_window(steps: int, chosen: tuple[int, int] | None) -> tuple[int, int]:
    """Which steps of a run of ``steps`` the profiler records: ``chosen`` (checked against
    the run), else the last up-to-3 steps after the first."""
    if chosen is None:
        start = 1 if steps > 1 else 0
        return max(start, steps - 3), steps
    if chosen[1] > steps:
        raise PlanError(f"--profile-steps {chosen[0]}:{chosen[1]} reaches past this run's "
                        f"{steps} steps; lower END or raise --steps")
    return chosen


# ``autopar run``'s own options (before the training ones): the one definition that both the
# CLI command and a generated program run as a script (``torchrun DIR/train.py ...``) parse
_RUN_OPTIONS = [
    click.argument("directory", type=click.Path(file_okay=False)),
    click.option("--steps", default=10, show_default=True, type=click.IntRange(min=1)),
    click.option("--data", default="synthetic", show_default=True,
                  help="'synthetic' (deterministic random tokens; a classifier's: random "
                       "samples and labels) or a token dataset PREFIX from `autopar data prepare`."),
    click.option("--seed", default=0, show_default=True, type=int,
                  help="Seeds the weights and the synthetic data (with --generate: the "
                       "sampling draws)."),
    click.option("--device", type=click.Choice(sorted(BACKENDS)), default=None,
                  help="Device type [default: the plan cluster's]."),
    click.option("--checkpoint-every", default=0, show_default=True, type=click.IntRange(min=0),
                  help="Save DIR/checkpoints every N steps (and always at the end)."),
    click.option("--keep-last", default=0, show_default=True, type=click.IntRange(min=0),
                  help="Keep only the newest N checkpoints in DIR/checkpoints (0: keep all)."),
    click.option("--no-final-save", "final_save", is_flag=True, default=True, flag_value=False,
                  help="Do not save a checkpoint after the last step (--checkpoint-every still "
                       "saves)."),
    click.option("--overwrite", is_flag=True,
                  help="Start a new run in a DIR whose checkpoints came from an earlier one (they "
                       "are replaced as this run saves); without it such a run is refused."),
    click.option("--timeout", "timeout_s", default=600, show_default=True,
                  type=click.IntRange(min=1),
                  help="Seconds a collective may wait for its peers before the job fails (first "
                       "steps may compile kernels or load large checkpoints)."),
    click.option("--resume", is_flag=True,
                  help="Continue from the latest checkpoint in DIR/checkpoints (any plan's)."),
    click.option("--init-from", type=click.Path(exists=True), default=None,
                  help="Start from a Hugging Face checkpoint (a save_pretrained folder of "
                       "safetensors): each rank reads only its slices."),
    click.option("--generate", "serving", is_flag=True,
                  help="Serve a generation artifact (compiled with --task infer) with its "
                       "generate.py: the latest checkpoint's weights, else the seed-0 ones."),
    click.option("--prompts", default=None,
                  help="With --generate: JSONL of {\"ids\": [...]} or {\"prompt\": \"...\"} lines, "
                       "or a text file of one prompt per line."),
    click.option("--max-new-tokens", default=32, show_default=True, type=int,
                  help="With --generate: new tokens per prompt, at most."),
    click.option("--sample", is_flag=True, help="With --generate: sample instead of greedy "
                                                 "decoding (--seed seeds the draws)."),
    click.option("--temperature", default=1.0, show_default=True, type=float),
    click.option("--top-k", type=int, default=None),
    click.option("--top-p", type=float, default=None),
    click.option("--eos", "eos_token_id", type=int, default=None,
                  help="With --generate: the stop token id."),
    click.option("--tokenizer", default=None,
                  help="With --generate: a Hugging Face tokenizer folder for text prompts and "
                       "output."),
]


def run_options(command: Callable) -> Callable:
    """Decorate ``command`` with ``autopar run``'s arguments and options: the artifact
    directory, the run's own options, generation's, then :func:`training_options`."""
    command = training_options(command)
    for option in reversed(_RUN_OPTIONS):
        command = option(command)
    return command
