"""The training loop's hyperparameters: AdamW's settings, weight-decay groups, gradient
clipping and the learning-rate schedule (warm-up, then constant, linear or cosine decay).

The schedule is a pure function of the step (:func:`lr_at`), so a resumed run, any plan and
one process set the same learning rate at the same step, and a test can check it against the
formula.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

from torch import nn

from autopar.errors import PlanError

DECAYS = ("constant", "linear", "cosine")


@dataclass(frozen=True)
class Hyperparameters:
    """What the optimizer and the schedule need; the ``autopar run`` options of the same names.

    ``lr`` is the peak learning rate, reached after ``warmup_steps`` steps of linear warm-up;
    ``decay`` then takes it to ``min_lr`` at step ``decay_steps`` (the schedule's horizon,
    warm-up included; None: the last step of the run). ``weight_decay`` applies to weights of
    two or more dimensions only: biases and norm scales are not decayed, as in Megatron-LM
    and torchtitan. ``grad_clip`` is the largest global gradient norm (0: no clipping).
    ``router_aux_coef`` and ``router_z_coef`` weigh a mixture of experts' router losses
    (:mod:`autopar.train.router_loss`; aux None: as the model's config says).
    ``capacity_factor`` caps the token copies each expert takes per sequence
    (:mod:`autopar.train.expert_capacity`; None: dropless routing, as the model defines it).
    """

    lr: float = 1e-3
    warmup_steps: int = 0
    decay: str = "constant"
    decay_steps: int | None = None
    min_lr: float = 0.0
    weight_decay: float = 0.01  # torch.optim.AdamW's default
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    grad_clip: float = 1.0
    router_aux_coef: float | None = None  # None: the model's config decides
    router_z_coef: float = 0.0
    capacity_factor: float | None = None  # None: dropless

    def __post_init__(self) -> None:
        if self.decay not in DECAYS:
            raise PlanError(f"unknown learning-rate decay '{self.decay}'; use one of "
                            f"{', '.join(DECAYS)}")
        if self.lr < 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise PlanError(f"the learning rate must be 0 or more and min_lr within [0, lr]; "
                            f"got lr={self.lr}, min_lr={self.min_lr}")
        if self.warmup_steps < 0 or (self.decay_steps is not None and self.decay_steps < 1):
            raise PlanError("warm-up steps must be 0 or more and decay steps 1 or more")
        if self.decay_steps is not None and self.warmup_steps > self.decay_steps:
            raise PlanError(f"{self.warmup_steps} warm-up steps exceed the schedule's "
                            f"{self.decay_steps} steps; lower --warmup-steps or raise "
                            f"--decay-steps")
        b1, b2 = self.betas
        if not (0 <= b1 < 1 and 0 <= b2 < 1):
            raise PlanError(f"Adam's betas must lie in [0, 1); got {self.betas}")
        if self.weight_decay < 0 or self.grad_clip < 0 or not self.eps > 0:
            raise PlanError("weight decay and gradient clipping must be 0 or more, eps positive")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise PlanError(f"the capacity factor must be more than 0 (or unset: dropless); "
                            f"got {self.capacity_factor}")

    def with_horizon(self, steps: int) -> Hyperparameters:
        """These settings with the schedule's horizon fixed (``decay_steps`` when unset)."""
        if self.decay_steps is not None:
            return self
        return replace(self, decay_steps=max(steps, 1))

    def as_dict(self) -> dict:
        d = asdict(self)
        d["betas"] = list(self.betas)
        return d


def lr_at(hp: Hyperparameters, step: int) -> float:
    """The learning rate of optimizer step ``step`` (0-based).

    Warm-up: ``lr * (step + 1) / warmup_steps`` for ``step < warmup_steps`` (the first step
    already moves). Then, with ``p = (step - warmup_steps) / (decay_steps - warmup_steps)``
    clamped to [0, 1]: constant ``lr``; linear ``lr - (lr - min_lr) * p``; cosine
    ``min_lr + (lr - min_lr) * (1 + cos(pi * p)) / 2``.
    """
    if step < hp.warmup_steps:
        return hp.lr * (step + 1) / hp.warmup_steps
    if hp.decay == "constant":
        return hp.lr
    if hp.decay_steps is None:
        raise PlanError("a decaying schedule needs its horizon: set decay_steps")
    span = max(hp.decay_steps - hp.warmup_steps, 1)
    progress = min(max((step - hp.warmup_steps) / span, 0.0), 1.0)
    if hp.decay == "linear":
        return hp.lr - (hp.lr - hp.min_lr) * progress
    return hp.min_lr + (hp.lr - hp.min_lr) * (1 + math.cos(math.pi * progress)) / 2


def decay_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """The trainable parameters as AdamW's groups: weights of two or more dimensions decayed,
    the rest (biases, norm scales) not. Shapes are the parameters' global ones (a DTensor's
    ``ndim`` is its whole tensor's), so every plan forms the same groups."""
    decayed, plain = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decayed if p.ndim >= 2 else plain).append(p)
    groups = [{"params": decayed, "weight_decay": weight_decay},
              {"params": plain, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def set_lr(optimizer, hp: Hyperparameters, lr: float) -> None:
    """Every group of ``optimizer`` at learning rate ``lr`` (what :func:`lr_at` gives for
    ``hp``), relative to the rate the group was built with: a program that builds a group
    at another rate (a hand edit of train.py) keeps its ratio, as under torch's LambdaLR. A
    ZeroRedundancyOptimizer copies its wrapper's groups to its partition at each step."""
    factor = lr / hp.lr if hp.lr else 0.0  # --lr 0: steps that change nothing
    for group in optimizer.param_groups:
        base = group.setdefault("initial_lr", group["lr"])
        group["lr"] = base * factor
