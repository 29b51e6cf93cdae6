"""``autopar.TrainingArguments``: a training run's settings under Hugging Face's names.

A name Hugging Face's ``TrainingArguments`` (or TRL's ``SFTConfig``) has is used here only
where it means the same thing; the names that would mean something else under a planner
(``fsdp``, ``deepspeed``, ``tp_size``, ...) are refused in one line that says what autopar does
instead, and an unknown name is refused with the nearest known one. The additions are what
a planner needs: ``global_batch_size`` (rows per optimizer step, whatever the layout),
``constraints`` (pins for the plan), ``cluster`` (the device profile to plan for).

The batch: Hugging Face's rows per optimizer step are ``per_device_train_batch_size x
gradient_accumulation_steps x processes``. autopar keeps that number, then lets the plan
decide how the rows are split (data, tensor, pipeline parallelism and micro-batches), so
that "per device" is a budget, not a layout. ``global_batch_size`` fixes the number instead,
so one script gives the same batches on any number of processes.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, fields

from autopar.errors import PlanError

# lr_scheduler_type -> (autopar's decay, whether the warm-up is read)
SCHEDULES = {"linear": ("linear", True), "cosine": ("cosine", True),
             "constant_with_warmup": ("constant", True), "constant": ("constant", False)}
STRATEGIES = ("no", "steps", "epoch")

# Hugging Face names that mean something else here: refused, saying what to do instead
REFUSED = {
    "fsdp": "autopar plans sharding itself; pin it with constraints={'zero': 3}",
    "fsdp_config": "autopar plans sharding itself; pin it with constraints={'zero': 3}",
    "deepspeed": "autopar plans ZeRO itself; pin it with constraints={'zero': N}, or read a "
                 "DeepSpeed config as constraints='ds_config.json'",
    "tp_size": "autopar plans tensor parallelism; pin it with constraints={'tp': N}",
    "parallelism_config": "autopar plans the layout; pin parts with constraints={...}",
    "per_gpu_train_batch_size": "use per_device_train_batch_size or global_batch_size",
    "per_gpu_eval_batch_size": "evaluation runs in the plan's batch layout",
    "per_device_eval_batch_size": "evaluation runs in the plan's batch layout (its global "
                                  "batch and micro-batches), over every held-out row",
    "local_rank": "torchrun sets the ranks; autopar reads them from the environment",
    "n_gpu": "the plan is made for the processes the run is launched with",
    "optim": "autopar trains with AdamW (adam_beta1, adam_beta2, adam_epsilon, weight_decay)",
    "torch_compile": "autopar runs the generated program eagerly",
    "auto_find_batch_size": "the plan fits the batch to memory before the run starts",
    "gradient_checkpointing_kwargs": "set gradient_checkpointing=True, or pin "
                                     "constraints={'recompute': 'selective'}",
    "lr_scheduler_kwargs": "use min_lr, warmup_steps and lr_scheduler_type",
    "label_smoothing_factor": "autopar's loss is the plain next-token cross-entropy",
    "resume_from_checkpoint": "pass it to trainer.train(resume_from_checkpoint=True)",
    "push_to_hub": "export with `autopar export DIR --to hf` and upload the folder",
    "group_by_length": "autopar packs rows to the sequence length; there is nothing to group",
    "dataloader_num_workers": "autopar reads packed token files, no data loader workers",
    "neftune_noise_alpha": "not in autopar",
    "tf32": "the plan's precision decides the compute dtype (bf16=True / fp16=True)",
}


@dataclass
class _Fields:
    # where the run writes: the plan, the generated program, data, logs and checkpoints
    output_dir: str = "autopar_output"
    overwrite_output_dir: bool = False
    # the batch (see the module docstring)
    per_device_train_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    global_batch_size: int | None = None
    max_seq_length: int | None = None  # tokens per packed row; None: min(model's, 512)
    dataset_text_field: str = "text"
    document_mask: bool = True  # keep packed documents apart where the model allows
    # how long
    max_steps: int = -1
    num_train_epochs: float = 3.0
    # the optimizer (AdamW) and the schedule
    learning_rate: float = 5e-5
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    max_grad_norm: float = 1.0
    lr_scheduler_type: str = "linear"
    warmup_steps: int = 0
    warmup_ratio: float = 0.0
    min_lr: float = 0.0
    # logging, evaluation, checkpoints
    logging_steps: int = 10
    eval_strategy: str = "no"
    eval_steps: int | None = None
    save_strategy: str = "steps"
    save_steps: int = 500
    save_total_limit: int | None = None
    # numerics and devices
    bf16: bool = False
    fp16: bool = False
    gradient_checkpointing: bool = False
    seed: int = 42
    use_cpu: bool = False
    # the planner's
    constraints: dict | str | None = None
    cluster: str | None = None
    memory_limit_gb: float | None = None


class TrainingArguments(_Fields):
    """A run's settings (see the module docstring); Hugging Face's names and defaults, but
    ``logging_steps`` (10: tiny runs log) and ``output_dir``."""

    def __init__(self, **kwargs: object) -> None:
        known = [f.name for f in fields(_Fields)]
        for name in kwargs:
            if name in REFUSED:
                raise PlanError(f"TrainingArguments({name}=...) is not read by autopar: "
                                f"{REFUSED[name]}")
            if name not in known:
                near = difflib.get_close_matches(name, known + list(REFUSED), n=1)
                hint = f"did you mean {near[0]}? " if near else ""
                raise PlanError(f"TrainingArguments has no argument {name!r}; {hint}"
                                f"autopar reads {', '.join(known)}")
        super().__init__(**kwargs)
        self._check()

    def _check(self) -> None:
        positive = ("per_device_train_batch_size", "gradient_accumulation_steps", "logging_steps", "save_steps")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise PlanError(f"{name} must be a positive integer, got {value!r}")
        for name in ("global_batch_size", "max_seq_length", "eval_steps", "save_total_limit"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise PlanError(f"{name} must be a positive integer or None, got {value!r}")
        if self.lr_scheduler_type not in SCHEDULES:
            raise PlanError(f"lr_scheduler_type {self.lr_scheduler_type!r} is not in autopar; "
                            f"use one of {', '.join(SCHEDULES)}")
        if self.lr_scheduler_type == "constant" and (self.warmup_steps or self.warmup_ratio):
            raise PlanError("lr_scheduler_type 'constant' has no warm-up (as in Hugging "
                            "Face); use 'constant_with_warmup' to warm up")
        if self.warmup_steps < 0 or not 0 <= self.warmup_ratio < 1:
            raise PlanError("warmup_steps must be 0 or more and warmup_ratio within [0, 1)")
        if self.warmup_steps and self.warmup_ratio:
            raise PlanError("give warmup_steps or warmup_ratio, not both")
        for name in ("eval_strategy", "save_strategy"):
            if getattr(self, name) not in STRATEGIES:
                raise PlanError(f"{name} must be one of {', '.join(STRATEGIES)}, got "
                                f"{getattr(self, name)!r}")
        if self.bf16 and self.fp16:
            raise PlanError("bf16 and fp16 are both set; choose one compute dtype")
        if self.max_steps == 0 or (self.max_steps < 0 and not self.num_train_epochs > 0):
            raise PlanError("set max_steps (a positive number of optimizer steps) or a "
                            "positive num_train_epochs")

    # --- what the run derives from them ----------------------------------------------------
    def global_batch(self, processes: int) -> int:
        """Rows per optimizer step on ``processes`` processes (see the module docstring)."""
        if self.global_batch_size is not None:
            return self.global_batch_size
        return self.per_device_train_batch_size * self.gradient_accumulation_steps * processes

    def steps(self, rows_per_epoch: int | None, global_batch: int) -> int:
        """Optimizer steps of the run: ``max_steps``, else ``num_train_epochs`` passes over
        ``rows_per_epoch`` packed rows (a streamed dataset has no length: max_steps)."""
        if self.max_steps > 0:
            return self.max_steps
        if rows_per_epoch is None:
            raise PlanError("a streamed dataset has no length; set max_steps")
        return max(1, math.ceil(self.num_train_epochs * rows_per_epoch / global_batch))

    def warmup(self, steps: int) -> int:
        """Warm-up steps: ``warmup_steps``, or ``ceil(warmup_ratio x steps)``, or none when
        the schedule is 'constant'."""
        if not SCHEDULES[self.lr_scheduler_type][1]:
            return 0
        return self.warmup_steps or math.ceil(self.warmup_ratio * steps)

    def precision(self) -> str | None:
        """The plan's precision pin: bf16, fp16, or None (the planner's choice: fp32 on CPU)."""
        return "bf16" if self.bf16 else "fp16" if self.fp16 else None

    def every(self, strategy: str, steps_value: int | None, steps_per_epoch: int) -> int:
        """How often (in steps) a strategy acts: 0 for 'no'."""
        if strategy == "no":
            return 0
        if strategy == "epoch":
            return max(1, steps_per_epoch)
        return steps_value or self.logging_steps

    def to_dict(self) -> dict:
        """The settings as plain values (what a run config file holds)."""
        return {f.name: getattr(self, f.name) for f in fields(_Fields)}
