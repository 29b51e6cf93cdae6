"""Validation loss and perplexity of the sharded model on held-out data, under any plan.

Each data-parallel (and expert-parallel) rank evaluates its rows of each held-out global
batch, in the plan's micro-batches, forward only; the cross-entropy is summed over tokens and
counted, and both are added up over the micro-batches, the pipeline's last stage and the
replicas before one division. The result is the mean over every held-out token, so it is the
same number one process computes, whatever the plan splits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from autopar.data.dataset import SyntheticTokens, TokenDataset, open_source
from autopar.train.loss import IGNORE_INDEX, summed_lm_loss

# synthetic held-out rows: the synthetic stream under another seed, far from any training
# step's (seed * 1_000_003 + step never reaches it)
HELD_OUT_SEED_OFFSET = 1 << 40


@dataclass(frozen=True)
class HeldOut:
    """Held-out data: ``"synthetic"`` or a token dataset PREFIX, and how many global batches
    of the plan's size one evaluation reads."""

    source: str = "synthetic"
    batches: int = 2


def held_out_source(held: HeldOut, vocab: int) -> TokenDataset | SyntheticTokens:
    """The token source of ``held`` (a dataset is checked against the model's vocabulary)."""
    return open_source(held.source, vocab)


def _rows(data, held: HeldOut, batch: int, global_batch: int, seq: int, seed: int,
          start: int, count: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    seed = seed + HELD_OUT_SEED_OFFSET if held.source == "synthetic" else seed
    window = (batch, global_batch, seq, seed, start, count)
    mask = getattr(data, "loss_mask", lambda *_: None)(*window)
    return data.rows(*window), mask


@torch.no_grad()
def evaluate(trainer, held: HeldOut, data=None) -> dict:
    """Evaluate ``trainer``'s model (an :class:`autopar.train.Trainer`) on ``held``; every
    rank calls it. Returns {"step", "loss", "perplexity", "tokens"}, the same on every rank,
    and logs it to the trainer's run log (rank 0)."""
    plan = trainer.plan
    data = data if data is not None else held_out_source(held, trainer.vocab)
    per_replica = plan.global_batch // (plan.mesh["dp"] * plan.mesh["ep"])
    m, b = plan.num_microbatches, plan.microbatch_size
    summed = torch.zeros((), dtype=torch.float64, device=trainer.device)
    counted = torch.zeros((), dtype=torch.float64, device=trainer.device)
    training = trainer.model.training
    trainer.model.eval()  # no dropout, nor R-Drop's second pass
    trainer.evaluating = True
    try:
        for batch in range(held.batches):
            ids, mask = _rows(data, held, batch, plan.global_batch, trainer.seq, trainer.seed,
                              trainer.dp_rank * per_replica, per_replica)
            ids = ids.to(trainer.device)
            targets = ids[:, 1:]
            if mask is not None:
                targets = targets.masked_fill(~mask[:, 1:].to(trainer.device), IGNORE_INDEX)
            cp = getattr(trainer, "cp", None)
            inputs = ids[:, :-1]
            if cp is not None:  # this cp rank's chunks of each sequence, summed over cp below
                inputs, targets = cp.shard(inputs), cp.shard(targets)
            if trainer.pipe is not None:
                s, c = _pipeline_sums(trainer, inputs, targets, m, b)
            else:
                s, c = _sums(trainer, inputs, targets, m, b)
            summed += s
            counted += c
    finally:
        trainer.evaluating = False
        trainer.model.train(training)
    if trainer.pipe is not None:  # only the last stage holds the losses
        for t in (summed, counted):
            dist.all_reduce(t, group=trainer.pp_group)
    if getattr(trainer, "cp", None) is not None:
        for t in (summed, counted):
            dist.all_reduce(t, group=trainer.cp.group)
    if trainer.replica_group is not None:
        for t in (summed, counted):
            dist.all_reduce(t, group=trainer.replica_group)
    loss = float(summed / counted.clamp(min=1))
    record = {"step": trainer.step_index, "loss": loss,
              "perplexity": math.exp(min(loss, 700.0)), "tokens": int(counted)}
    if trainer.log is not None:
        trainer.log.evaluation(record)
    return record


def _sums(trainer, inputs: torch.Tensor, targets: torch.Tensor, m: int, b: int
          ) -> tuple[torch.Tensor, torch.Tensor]:
    summed = torch.zeros((), dtype=torch.float64, device=trainer.device)
    counted = torch.zeros((), dtype=torch.float64, device=trainer.device)
    for i in range(m):
        rows = slice(i * b, (i + 1) * b)
        with trainer._loss_context(), trainer._compute():
            s, c = summed_lm_loss(trainer.model(inputs[rows],
                                                **trainer.position_kwargs(inputs[rows])),
                                  targets[rows])
        summed += s.double()
        counted += c.double()
    return summed, counted


def _pipeline_sums(trainer, inputs: torch.Tensor, targets: torch.Tensor, m: int, b: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The schedule's forward-only pass: the last stage's loss function returns each
    micro-batch's mean (:meth:`Trainer.loss`), weighed back by its token count here."""
    losses: list[torch.Tensor] = []
    with trainer._compute():
        trainer.pipe.eval(inputs, target=targets, losses=losses, return_outputs=False)
    zero = torch.zeros((), dtype=torch.float64, device=trainer.device)
    if not losses:  # not the last stage
        return zero, zero.clone()
    counts = [(targets[i * b:(i + 1) * b] != IGNORE_INDEX).sum().double() for i in range(m)]
    summed = sum((loss.detach().double() * c for loss, c in zip(losses, counts, strict=True)),
                 zero)
    return summed, sum(counts, zero)
