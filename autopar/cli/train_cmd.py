"""``autopar train|finetune|eval|predict CONFIG.yaml`` and ``autopar init``: a run described by
one YAML file (autopar.api.run_config; MindFormers run YAMLs too), run by
:class:`autopar.Trainer` as one process or as each rank of ``torchrun ... -m autopar``.

Every command reads and checks the whole config (and ``--set`` overrides) before anything is
written; a mistake is one line and exit code 2. Rank 0 prints; every rank runs.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import click

from autopar.api.run_config import (
    RunConfig,
    build_trainer,
    has_weights,
    load_eval_set,
    load_run_config,
    read_prompts,
    resume_weights,
    unused_line,
)
from autopar.errors import PlanError
from autopar.plan.plan import write_text_atomic
from autopar.train.checkpoint import latest_checkpoint
from autopar.train.launch import teardown

# what `autopar init` writes: every line runs as written (tiny-llama on the shipped text set,
# on the CPU, in well under a minute)
STARTER = """\
# autopar run config: `autopar train autopar.yaml` trains, `autopar eval autopar.yaml` scores
# the trained model, `autopar predict autopar.yaml` generates from it. Under torchrun
# (`torchrun --nproc-per-node 4 -m autopar train autopar.yaml`) autopar plans for 4 devices.
# Change a value for one run with --set, e.g. --set training.max_steps=50.
# Relative paths below are read from this file's folder; training.output_dir is relative to
# the directory you run in. A MindFormers run YAML works in place of this file too.

model: tiny-llama          # a shipped name (autopar inspect --list), a Hugging Face folder
                           # (config.json, weights and tokenizer), or an autopar run folder
tokenizer: null            # a tokenizer folder; default: the model's (tiny-llama ships one)
peft: null                 # fine-tuning, e.g. {method: lora, r: 8, lora_alpha: 16}

data:
  # a source is {path: FILE} (.jsonl/.json/.csv/.parquet/.txt), {prepared: PREFIX} (from
  # `autopar data prepare`), {set: tiny-text} (shipped), or
  # {blend: [{path: a.jsonl, weight: 0.7}, {set: tiny-text, weight: 0.3}]};
  # split takes datasets' slices of a path or set source
  train: {set: tiny-text, split: "train[:90%]"}
  eval: {set: tiny-text, split: "train[90%:]"}
  streaming: false         # read path sources as streams (then training needs max_steps)
  text_field: text         # the column holding the text

plan:
  constraints: null        # pins, e.g. {tp: 2, dp: 2}, "pp=2", or a MindFormers/DeepSpeed file
  cluster: cpu             # the device profile the plan is priced on (cpu, a100-80g, h100-80g...)
  memory_limit_gb: null    # usable memory per device; default: the cluster's

training:                  # Hugging Face TrainingArguments' names
  output_dir: autopar-run  # plan, program, data, logs/ and checkpoints/
  overwrite_output_dir: false
  max_steps: 30
  global_batch_size: 8     # rows per optimizer step, whatever the plan's layout
  max_seq_length: 32       # tokens per packed row
  learning_rate: 3.0e-3
  lr_scheduler_type: cosine
  warmup_steps: 3
  weight_decay: 0.0
  logging_steps: 10
  eval_strategy: steps     # held-out loss and perplexity every eval_steps
  eval_steps: 15
  save_strategy: steps     # checkpoints every save_steps, and after the last step
  save_steps: 30
  seed: 42
  use_cpu: true

evaluation:
  sets: [tiny-choice, tiny-qa]   # scored by `autopar eval` after the loss and perplexity

predict:                   # what `autopar predict` generates from
  prompts: ["the red cat", "the brown dog"]   # or a .txt / .jsonl file
  max_new_tokens: 12
  do_sample: false
"""


def _rank0() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def _config_options(command: Callable) -> Callable:
    command = click.option("--steps", type=click.IntRange(min=1), default=None,
                           help="Shorthand for --set training.max_steps=N.")(command)
    command = click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
                           help="Set a field for this run (repeatable), the value read as "
                                "YAML: --set training.learning_rate=1e-3 --set "
                                "'data.train={set: tiny-text}'.")(command)
    return click.argument("config", type=click.Path(dir_okay=False, path_type=Path))(command)


def _load(config: Path, overrides: tuple[str, ...], steps: int | None) -> RunConfig:
    items = [*overrides, *([f"training.max_steps={steps}"] if steps else [])]
    run = load_run_config(config, items, warn=False)
    if run.unused and _rank0():
        click.echo(unused_line(run.unused), err=True)
    return run


def _in_job(work: Callable[[], object]) -> object:
    """``work()``, then the job's process group torn down in order (see teardown); the
    trainer ``work`` builds is out of scope by then."""
    finished = False
    try:
        result = work()
        finished = True
        return result
    finally:
        teardown(int(os.environ.get("WORLD_SIZE", "1")), finished)


def _train(run: RunConfig, resume: bool, finetune: bool) -> None:
    if run.data.train is None:
        raise PlanError("the run config has no data.train; add e.g. data: {train: {set: "
                        "tiny-text}}")
    what = _what_is_finetuned(run) if finetune else None
    ckpt = Path(run.training.output_dir) / "checkpoints"
    last = latest_checkpoint(ckpt)
    if last is not None and not resume and not run.training.overwrite_output_dir:
        raise PlanError(f"{ckpt} holds {last.name} from an earlier run; pass --resume to "
                        f"continue it, or --set training.overwrite_output_dir=true to start "
                        f"a new run")

    def work() -> tuple[list[float], int]:
        trainer = build_trainer(run)
        if what and _rank0():
            click.echo(what, err=True)
        out = trainer.train(resume_from_checkpoint=True if resume else None)
        return trainer.state["losses"], out.global_step

    losses, step = _in_job(work)
    if _rank0():
        log = Path(run.training.output_dir) / "logs" / "train.jsonl"
        click.echo(f"trained to step {step}: loss {losses[0]:.4f} -> {losses[-1]:.4f}; "
                   f"log {log}")


def _what_is_finetuned(run: RunConfig) -> str:
    """What `autopar finetune` trains, in words; a PlanError when there is nothing to
    fine-tune (no adapters and no weights)."""
    name = run.model if isinstance(run.model, str) else "the inline model"
    if run.peft is not None:
        what = f"adapters ({run.peft if isinstance(run.peft, str) else dict(run.peft)})"
        start = "its weights" if has_weights(name) else "its seeded weights"
        return f"fine-tuning {what} on {name}, from {start}"
    if not has_weights(name):
        raise PlanError(f"autopar finetune needs weights to start from or adapters to train: "
                        f"{name} has no weights (a shipped name or config is seeded); set "
                        f"model to a Hugging Face folder with *.safetensors (or a trained run "
                        f"folder), or set peft (e.g. --set 'peft={{method: lora, r: 8}}'), "
                        f"or use autopar train")
    return f"fine-tuning every weight of {name}, from its weights"


@click.command("train", short_help="Train as a run config YAML (or a MindFormers one) says.")
@_config_options
@click.option("--resume", is_flag=True,
              help="Continue from the latest checkpoint in training.output_dir.")
def train_cmd(config: Path, overrides: tuple[str, ...], steps: int | None,
              resume: bool) -> None:
    """Train the model a run CONFIG describes (autopar's YAML or a MindFormers run YAML):
    plan for the processes launched, compile into training.output_dir, train. --set and
    --steps name fields as autopar's run config does, for a MindFormers file too (its
    fields autopar does not use are listed in one line first).

    \b
    Examples:
      autopar init && autopar train autopar.yaml
      autopar train autopar.yaml --steps 5 --set training.learning_rate=1e-3
      torchrun --nproc-per-node 4 -m autopar train autopar.yaml --set 'plan.constraints={tp: 2}'
      autopar train pretrain_llama2_7b.yaml       # a MindFormers run YAML
    """
    _train(_load(config, overrides, steps), resume, finetune=False)


@click.command("finetune", short_help="Fine-tune as a run config YAML says (adapters or weights).")
@_config_options
@click.option("--resume", is_flag=True,
              help="Continue from the latest checkpoint in training.output_dir.")
def finetune_cmd(config: Path, overrides: tuple[str, ...], steps: int | None,
                 resume: bool) -> None:
    """Fine-tune as a run CONFIG describes: adapters (peft) or every weight of a model that
    has weights (a Hugging Face folder with safetensors, a trained run folder).

    \b
    Examples:
      autopar finetune sft.yaml --set 'peft={method: lora, r: 8}'
      torchrun --nproc-per-node 2 -m autopar finetune sft.yaml
    """
    _train(_load(config, overrides, steps), resume, finetune=True)


@click.command("eval", short_help="Evaluate a run config's model: loss, perplexity, scored sets.")
@_config_options
def eval_cmd(config: Path, overrides: tuple[str, ...], steps: int | None) -> None:
    """Evaluate: the loss and perplexity on data.eval, then each of evaluation.sets
    (accuracy, exact match), printed as one JSON object. The weights are the latest
    checkpoint in training.output_dir (a trained run), else the model's own.

    \b
    Examples:
      autopar eval autopar.yaml
      autopar eval autopar.yaml --set 'evaluation.sets=[tiny-choice]'
    """
    run = _load(config, overrides, steps)
    if run.data.eval is None and not run.evaluation.sets:
        raise PlanError("nothing to evaluate: add data.eval (held-out text) or evaluation.sets "
                        "(e.g. [tiny-choice, tiny-qa]) to the run config")

    def work() -> dict:
        trainer = build_trainer(run)
        metrics: dict = {"weights": resume_weights(trainer)}
        if run.data.eval is not None:
            metrics.update(trainer.evaluate())
        for name in run.evaluation.sets:
            metrics.update(trainer.evaluate(load_eval_set(name),
                                            metric_key_prefix=Path(name).stem))
        return metrics

    metrics = _in_job(work)
    if _rank0():
        click.echo(json.dumps(metrics))


@click.command("predict", short_help="Generate from a run config's prompts, one JSON line each.")
@_config_options
def predict_cmd(config: Path, overrides: tuple[str, ...], steps: int | None) -> None:
    """Generate from predict.prompts with predict's settings: one JSON line per prompt
    ({"prompt", "text"}). The weights are the latest checkpoint in training.output_dir,
    else the model's own.

    \b
    Examples:
      autopar predict autopar.yaml
      autopar predict autopar.yaml --set 'predict.prompts=[the cat]' --set predict.do_sample=true
    """
    run = _load(config, overrides, steps)
    if run.predict is None:
        raise PlanError("the run config has no predict section; add predict: {prompts: "
                        "[\"the cat\"]} (or a .txt/.jsonl file of prompts)")
    prompts = read_prompts(run.predict.prompts)

    def work() -> list[str]:
        trainer = build_trainer(run)
        resume_weights(trainer)
        return trainer.predict(prompts, **run.predict.generation()).predictions

    texts = _in_job(work)
    if _rank0():
        for prompt, text in zip(prompts, texts, strict=True):
            click.echo(json.dumps({"prompt": prompt, "text": text}))


@click.command("init", short_help="Write a commented starting run config (autopar.yaml).")
@click.argument("path", default="autopar.yaml", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--force", is_flag=True, help="Replace an existing file.")
def init_cmd(path: Path, force: bool) -> None:
    """Write a commented starting run config to PATH (default autopar.yaml) that trains the
    shipped tiny Llama on the shipped text set on the CPU as written.

    \b
    Examples:
      autopar init && autopar train autopar.yaml
      autopar init runs/first.yaml --force
    """
    if path.exists() and not force:
        raise PlanError(f"{path} exists; pass --force to replace it, or name another file")
    if not (path.parent if str(path.parent) else Path(".")).is_dir():
        raise PlanError(f"cannot write {path}: folder {path.parent} does not exist; create it "
                        f"first")
    write_text_atomic(path, STARTER)
    click.echo(f"wrote {path}; train with: autopar train {path}")
