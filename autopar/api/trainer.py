"""``autopar.Trainer``: train, evaluate and generate in a few lines, under the plan autopar
makes for the processes the script is launched on (one process, a notebook, or torchrun).

What it does, in order, on construction:

1. joins torchrun's process group when launched with several processes;
2. plans the model for that many devices (``args``' batch, sequence length and constraints;
   ``plan=`` skips this) and writes the artifact to ``args.output_dir``: plan.yaml, the
   generated program it runs (train.py), later logs/ and checkpoints/, as ``autopar compile``
   does;
3. writes the datasets as token files under ``OUTPUT_DIR/data`` (autopar.data.hf_datasets);
4. builds the runtime's trainer (autopar.train.Trainer): each rank allocates only its shards.

Rank 0 plans and writes; the other ranks wait for it and read what it wrote, so every rank
runs the same plan. An error on rank 0 is raised on every rank, in the same words.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from autopar.api.arguments import SCHEDULES, TrainingArguments
from autopar.api.devices import cluster_for, device_kind, world
from autopar.api.generation import PredictionOutput, generate_texts, need_tokenizer, predict
from autopar.api.model_input import resolve_model, snapshot_weights
from autopar.artifact import load_artifact
from autopar.artifact.load import is_artifact
from autopar.codegen import compile_artifact
from autopar.data.blend import is_blend, parse_blend
from autopar.data.dataset import dataset_prefix, open_source
from autopar.data.hf_datasets import (
    dataset_kind,
    is_hf_dataset,
    is_streamed,
    prepare_hf_dataset,
)
from autopar.data.instruction import load_hf_tokenizer
from autopar.errors import PlanError
from autopar.metrics.tasks import multiple_choice_accuracy, qa_exact_match, set_kind
from autopar.models.hf import load_config
from autopar.parallel.rank_zero import on_rank_zero
from autopar.plan import Plan
from autopar.search.api import plan as make_plan
from autopar.serve.hf_export import export_hf
from autopar.train.checkpoint import latest_checkpoint, save_checkpoint
from autopar.train.evaluate import HeldOut, evaluate
from autopar.train.launch import init_process_group, run_program
from autopar.train.optim import Hyperparameters
from autopar.train.run_flags import BACKENDS
from autopar.train.run_log import RunLog, archive_logs
from autopar.train.trainer import Trainer as RuntimeTrainer

DEFAULT_SEQ = 512  # a packed row's tokens when neither the arguments nor the model say less


@dataclass
class TrainOutput:
    """What :meth:`Trainer.train` returns, as Hugging Face's: the last step, the mean loss
    of this run's steps, and the run's numbers."""

    global_step: int
    training_loss: float
    metrics: dict = field(default_factory=dict)


class Trainer:
    """Train ``model`` (a shipped name, a Hugging Face folder, an artifact or an nn.Module)
    on ``train_dataset`` and evaluate on ``eval_dataset`` (Hugging Face ``datasets``:
    text, instruction pairs, conversations or token ids; streamed ones too), with
    ``args`` (:class:`TrainingArguments`). ``tokenizer`` (or Hugging Face's
    ``processing_class``): a loaded tokenizer or its folder (default: the model folder's,
    or the shipped tiny one for the shipped tiny configs). ``peft``: a fine-tuning method
    (e.g. ``{"method": "lora", "r": 8}``); ``plan``: run this plan instead of planning.
    See the module docstring for what happens on construction."""

    def __init__(self, model: object, args: TrainingArguments | None = None,
                 train_dataset: object = None, eval_dataset: object = None,
                 data_collator: object = None, *, tokenizer: object = None,
                 processing_class: object = None, peft: dict | str | None = None,
                 plan: Plan | None = None) -> None:
        if data_collator is not None:
            raise PlanError("autopar packs rows itself (documents to the sequence length, a "
                            "loss mask for instruction data); leave data_collator unset")
        if tokenizer is not None and processing_class is not None:
            raise PlanError("pass tokenizer or processing_class, not both")
        self.args = args = args if args is not None else TrainingArguments()
        if not isinstance(args, TrainingArguments):
            raise PlanError(f"args is an autopar.TrainingArguments, got {type(args).__name__}")
        self.world, self.rank = world()
        self.device_kind = device_kind(args)
        self._join()
        self.output_dir = Path(args.output_dir)
        self.model_input = resolve_model(model)
        self.tokenizer = self._tokenizer(tokenizer if tokenizer is not None
                                         else processing_class)
        self.peft = peft
        for dataset in (train_dataset, eval_dataset):  # bad data fails before planning
            self._check_data(dataset)
        on_rank_zero(lambda: self._plan_and_compile(plan))

        self.manifest, self.plan = load_artifact(self.output_dir)
        self.seq = self.plan.seq
        self.global_batch = self.plan.global_batch
        self.train_data = self._prepare("train", train_dataset) if train_dataset is not None \
            else None
        self.eval_data = self._prepare("eval", eval_dataset) if eval_dataset is not None \
            else None
        self._runtime = None
        self.state: dict = {"global_step": 0, "log_history": []}

    # --- construction ---------------------------------------------------------------------
    def _join(self) -> None:
        if self.world > 1 and not dist.is_initialized():
            if self.device_kind != "cpu":
                torch.accelerator.set_device_index(int(os.environ.get("LOCAL_RANK", "0")))
            init_process_group(BACKENDS[self.device_kind])

    def _tokenizer(self, given: object):

        if given is None:
            given = self.model_input.tokenizer
        if given is None:
            return None
        return load_hf_tokenizer(given) if isinstance(given, (str, Path)) else given

    def _check_data(self, dataset: object) -> None:
        """A Hugging Face dataset's kind from its columns, and the tokenizer it needs."""
        parts = dataset if isinstance(dataset, (list, tuple)) else [(dataset, 1.0)]
        for part in parts:
            data = part[0] if isinstance(part, (list, tuple)) and part else part
            if not is_hf_dataset(data) or _is_task_set(data):
                continue
            kind = dataset_kind(data, self.args.dataset_text_field)
            if kind != "tokens" and self.tokenizer is None:
                raise PlanError(f"{kind} data needs the model's tokenizer: pass "
                                f"tokenizer=FOLDER (or a model folder that holds one)")

    def _seq(self) -> int:
        if self.args.max_seq_length is not None:
            return self.args.max_seq_length
        config = getattr(self.model_input.module, "config", None)
        if config is None and isinstance(self.model_input.plan_input, str):

            config = load_config(self.model_input.plan_input)
        context = getattr(config, "max_position_embeddings", None) or \
            (config.get("max_position_embeddings") if isinstance(config, dict) else None)
        return min(int(context), DEFAULT_SEQ) if context else DEFAULT_SEQ

    def _constraints(self) -> object:
        pins: dict = {}
        if self.args.precision() is not None:
            pins["precision"] = self.args.precision()
        if self.args.gradient_checkpointing:
            pins["recompute"] = "full"
        given = self.args.constraints
        if given is None:
            return pins or None
        if isinstance(given, dict):
            return {**given, **pins}
        return [given, pins] if pins else given

    def _plan_and_compile(self, plan: Plan | None) -> None:
        """Rank 0: plan (unless given) and write the artifact in the output directory."""

        out = self.output_dir
        if out.is_dir() and any(out.iterdir()) and not is_artifact(out):
            raise PlanError(f"output_dir {out} exists and is not an autopar run directory; "
                            f"choose an empty or new output_dir")
        source = self.model_input.plan_input
        example = None
        if self.model_input.module is not None:
            example = (torch.zeros(1, self._seq(), dtype=torch.long),)
        if plan is None:
            task = "finetune" if self.peft else "train"
            seq = None if example is not None else self._seq()
            plan = make_plan(
                source, example, devices=self.world,
                cluster=self.args.cluster or cluster_for(self.device_kind), task=task,
                global_batch=self.args.global_batch(self.world), seq=seq,
                constraints=self._constraints(), memory_limit_gb=self.args.memory_limit_gb,
                peft=self.peft)
        plan.check_world_size(self.world)
        compile_artifact(source, example, plan, out)
        if self.model_input.module is not None:  # its weights, read by every rank
            snapshot_weights(self.model_input.module, out / "init")

    def _prepare(self, name: str, dataset: object) -> dict:
        """The token data of ``dataset``: {"prefix" (what the runtime opens), "rows" (whole
        packed rows of one epoch, None for a stream), ...}. A Hugging Face dataset is written
        by rank 0 as OUTPUT_DIR/data/NAME; a prepared token dataset (``autopar data
        prepare``'s PREFIX) is read where it is; a list of ``(dataset, weight)`` pairs is a
        blend of them (autopar.data.blend)."""
        if isinstance(dataset, (list, tuple)):
            return self._blend(name, dataset)
        if isinstance(dataset, (str, Path)):
            prefix = str(dataset) if str(dataset) == "synthetic" or is_blend(str(dataset)) \
                else str(dataset_prefix(dataset))
            source = open_source(prefix, self.model_input.vocab)
            rows = source.num_windows(self.seq) if hasattr(source, "num_windows") else None
            return {"kind": "prepared", "prefix": prefix, "rows": rows}
        rows = None
        if is_streamed(dataset) and name.startswith("train"):
            if self.args.max_steps <= 0:
                raise PlanError("a streamed dataset has no length; set max_steps")
            rows = self.args.max_steps * self.global_batch
        elif is_streamed(dataset):
            rows = 64 * self.global_batch  # an evaluation reads at most 64 batches
        prefix = self.output_dir / "data" / name
        stats = on_rank_zero(lambda: prepare_hf_dataset(
            dataset, prefix, self.tokenizer, self.seq, vocab=self.model_input.vocab,
            text_field=self.args.dataset_text_field, max_rows=rows))
        return {**stats, "rows": None if is_streamed(dataset) else stats["rows"]}

    def _blend(self, name: str, parts: list | tuple) -> dict:
        if not parts or not all(isinstance(p, (list, tuple)) and len(p) == 2 for p in parts):
            raise PlanError("a blend is a list of (dataset, weight) pairs, e.g. [(web, 0.7), "
                            "(code, 0.3)]")
        prepared = [(float(w), self._prepare(f"{name}-{i}", d))
                    for i, (d, w) in enumerate(parts)]
        spec = " ".join(f"{w!r} {p['prefix']}" for w, p in prepared)
        parse_blend(spec)  # weights checked here, in one line
        rows = [p["rows"] for _, p in prepared]
        return {"kind": "blend", "prefix": spec,
                "rows": None if None in rows else sum(rows)}

    # --- the runtime ----------------------------------------------------------------------
    def _hyper(self, steps: int):

        a = self.args
        return Hyperparameters(lr=a.learning_rate, warmup_steps=a.warmup(steps),
                               decay=SCHEDULES[a.lr_scheduler_type][0], decay_steps=steps,
                               min_lr=a.min_lr, weight_decay=a.weight_decay,
                               betas=(a.adam_beta1, a.adam_beta2), eps=a.adam_epsilon,
                               grad_clip=a.max_grad_norm)

    def total_steps(self) -> int:
        """The run's optimizer steps (max_steps, or its epochs over the training rows)."""
        if self.train_data is None:
            raise PlanError("no train_dataset: pass one to autopar.Trainer to train")
        return self.args.steps(self.train_data["rows"], self.global_batch)

    def _ensure_runtime(self):
        """The runtime's trainer, built once: it reads the training rows (synthetic ones
        when there are none: evaluation reads its own data)."""

        if self._runtime is not None:
            return self._runtime
        program = run_program(str(self.output_dir), self.manifest, self.plan)
        init = self.output_dir / "init" if self.model_input.module is not None else \
            self.model_input.init_from
        data = self.train_data["prefix"] if self.train_data is not None else "synthetic"
        steps = self.total_steps() if self.train_data is not None else 1
        self._runtime = RuntimeTrainer(
            self.manifest["model"], self.plan, program=program, device=self.device_kind,
            seed=self.args.seed, hyper=self._hyper(steps), data=data, init_from=init,
            document_mask=self.args.document_mask)
        if self.rank == 0 and self.train_data is not None:
            print(f"autopar: {self._runtime.document_choice}", file=sys.stderr)
        return self._runtime

    @property
    def model(self):
        """The parallelised model this rank trains (its shards; None before train or
        evaluate built it)."""
        return self._runtime.model if self._runtime is not None else None

    def _held_out(self, data: dict):

        rows = data["rows"] if data["rows"] is not None else data.get("tokens", 0) // (
            self.seq + 1)
        batches = max(1, min(64, rows // self.global_batch))
        return HeldOut(data["prefix"], batches)

    def train(self, resume_from_checkpoint: bool | str | None = None) -> TrainOutput:
        """Train for the arguments' steps; ``resume_from_checkpoint=True`` continues from
        the latest checkpoint in OUTPUT_DIR/checkpoints (a new run is refused there unless
        ``overwrite_output_dir``). Returns a :class:`TrainOutput`."""

        steps = self.total_steps()
        ckpt = self.output_dir / "checkpoints"
        resume = bool(resume_from_checkpoint)
        if isinstance(resume_from_checkpoint, str):
            raise PlanError("resume_from_checkpoint takes True (the latest checkpoint in "
                            "OUTPUT_DIR/checkpoints); autopar keeps one run per output_dir")
        last = latest_checkpoint(ckpt)
        if last is not None and not resume and not self.args.overwrite_output_dir \
                and self._runtime is None:
            raise PlanError(f"{ckpt} holds {last.name} from an earlier run; pass "
                            f"resume_from_checkpoint=True to continue it, or set "
                            f"overwrite_output_dir=True to start a new run")
        if self._runtime is None and not resume and self.rank == 0:
            archive_logs(self.output_dir / "logs")
        runtime = self._ensure_runtime()
        runtime.hyper = self._hyper(steps)
        if self.rank == 0:
            runtime.log = RunLog(self.output_dir / "logs", console=True, tensorboard=True,
                                 every=self.args.logging_steps, resume=resume)
        if resume:
            runtime.resume(ckpt)
        steps_per_epoch = max(1, (self.train_data["rows"] or steps * self.global_batch)
                              // self.global_batch)
        eval_every = self.args.every(self.args.eval_strategy, self.args.eval_steps,
                                     steps_per_epoch)
        evaluator = None
        if eval_every and self.eval_data is not None:
            held = self._held_out(self.eval_data)
            evaluator = lambda t: self._log_eval(evaluate(t, held))  # noqa: E731
        save_every = self.args.every(self.args.save_strategy, self.args.save_steps,
                                     steps_per_epoch)
        remaining = steps - runtime.step_index
        if remaining <= 0:
            raise PlanError(f"the checkpoint is at step {runtime.step_index} of {steps}; "
                            f"raise max_steps to train further")
        start = time.perf_counter()
        losses = runtime.train(remaining, checkpoint_dir=ckpt if save_every else None,
                               checkpoint_every=save_every, evaluate=evaluator,
                               eval_every=eval_every,
                               keep_last=self.args.save_total_limit or 0,
                               final_save=bool(save_every))
        seconds = time.perf_counter() - start
        self.state["global_step"] = runtime.step_index
        self.state["losses"] = losses
        metrics = {"train_loss": sum(losses) / len(losses), "losses": losses,
                   "train_runtime": seconds,
                   "train_steps_per_second": len(losses) / seconds if seconds else None,
                   "train_samples_per_second":
                       len(losses) * self.global_batch / seconds if seconds else None}
        return TrainOutput(runtime.step_index, metrics["train_loss"], metrics)

    def finetune(self, resume_from_checkpoint: bool | None = None) -> TrainOutput:
        """MindFormers' name for training from pretrained weights: :meth:`train`, refused
        when there is nothing to fine-tune from (neither a fine-tuning method nor starting
        weights: a Hugging Face folder with safetensors, an artifact, a module)."""
        if not self.peft and self.model_input.module is None and \
                self.model_input.init_from is None:
            raise PlanError("finetune starts from pretrained weights: pass a Hugging Face "
                            "folder with safetensors (or an artifact, or a module), or a "
                            "fine-tuning method with peft=...; to train from scratch call "
                            "train()")
        return self.train(resume_from_checkpoint)

    def _log_eval(self, record: dict) -> dict:
        self.state["log_history"].append({f"eval_{k}": v for k, v in record.items()})
        return record

    def evaluate(self, eval_dataset: object = None, metric_key_prefix: str = "eval") -> dict:
        """The loss and perplexity on held-out text (every held-out token, any plan); on a
        multiple-choice set (question, choices, answer), its accuracy by log-likelihood; on
        a question-answer set (question, answer), the exact match of the greedy answers.
        Keys carry ``metric_key_prefix`` as Hugging Face's: ``eval_loss``,
        ``eval_perplexity``, ``eval_accuracy``."""
        if eval_dataset is not None and _is_task_set(eval_dataset):
            metrics = self._task_metrics(eval_dataset)
        else:
            metrics = self._loss_metrics(eval_dataset)
        return {f"{metric_key_prefix}_{k}": v for k, v in metrics.items()}

    def _loss_metrics(self, eval_dataset: object) -> dict:

        data = self._prepare("eval", eval_dataset) if eval_dataset is not None else \
            self.eval_data
        if data is None:
            raise PlanError("no eval_dataset: pass one to autopar.Trainer or to evaluate()")
        record = evaluate(self._ensure_runtime(), self._held_out(data))
        return {"loss": record["loss"], "perplexity": record["perplexity"],
                "tokens": record["tokens"]}

    def _task_metrics(self, dataset: object) -> dict:

        records = [dict(r) for r in dataset]
        if set_kind(records) == "multiple_choice":
            runtime = self._ensure_runtime()
            shape = {}
            if runtime.pipe is not None:  # a pipeline's traced shape
                shape = {"width": self.seq,
                         "batch_size": self.plan.num_microbatches * self.plan.microbatch_size}
            return multiple_choice_accuracy(runtime.logits, need_tokenizer(self), records,
                                            **shape)
        return qa_exact_match(lambda prompts: generate_texts(self, prompts), records)

    # --- generation -----------------------------------------------------------------------
    def predict(self, test_dataset: object, **generation) -> PredictionOutput:
        """Generate from the model's current weights: ``test_dataset`` is a prompt, a list of
        prompts, or a dataset whose ``prompt`` / ``question`` / text column holds them (with
        an ``answer`` column, the exact match is computed). ``generation`` takes Hugging
        Face's names (max_new_tokens, do_sample, temperature, top_k, top_p). Every rank
        returns the same texts."""
        return predict(self, test_dataset, **generation)

    def save_model(self, output_dir: str | None = None) -> Path:
        """Save a checkpoint of the current weights (OUTPUT_DIR/checkpoints), or, with
        ``output_dir``, a Hugging Face folder (safetensors, config, tokenizer) there."""

        runtime = self._ensure_runtime()
        path = save_checkpoint(runtime, self.output_dir / "checkpoints",
                               self.args.save_total_limit or 0)
        if output_dir is None:
            return path

        def export() -> None:

            export_hf(self.output_dir, output_dir)
            if self.tokenizer is not None:
                self.tokenizer.save_pretrained(output_dir)

        on_rank_zero(export)
        return Path(output_dir)


def _is_task_set(dataset: object) -> bool:
    """A multiple-choice or question-answer set (scored by its answers), not text."""
    columns = set(getattr(dataset, "column_names", None) or [])
    return "choices" in columns or {"question", "answer"} <= columns
