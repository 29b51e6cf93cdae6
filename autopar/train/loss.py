"""The loss of a micro-batch: a language model's next-token cross-entropy over the trained
targets, and R-Drop's two-pass form; a classifier's cross-entropy against its labels. Logits
split over the vocabulary (a column-parallel LM head) stay split: the loss is computed
vocabulary-parallel, under ``loss_parallel`` (the caller's context), as the cost model prices
it."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from autopar.parallel.context_parallel import ContextParallel

IGNORE_INDEX = -100  # a target the loss skips (cross_entropy's default ignore_index)


def logits_of(out: object) -> torch.Tensor:
    """The logits of a model's output (a ModelOutput, a tuple, or the tensor itself)."""
    if hasattr(out, "logits"):
        return out.logits
    return out[0] if isinstance(out, (tuple, list)) else out


def vocab_split(t: object) -> bool:
    """Whether ``t`` is a DTensor split along its last (vocabulary) dimension."""
    placements = getattr(t, "placements", None)
    return bool(placements) and any(p.is_shard(t.ndim - 1) or p.is_shard(-1)
                                    for p in placements)


def full(t: torch.Tensor) -> torch.Tensor:
    """``t`` whole: a DTensor gathered, a plain tensor as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def lm_loss(output: object, targets: torch.Tensor, rdrop_alpha: float | None = None
            ) -> torch.Tensor:
    """Mean next-token cross-entropy (fp32) over the targets that are not ``IGNORE_INDEX``
    (instruction data's prompt tokens); zero, with gradients, when none are. With
    ``rdrop_alpha`` the logits hold two passes of the batch (R-Drop) and the loss is
    :func:`rdrop_loss`."""
    logits = logits_of(output)
    if not vocab_split(logits):
        logits = full(logits)
    if rdrop_alpha is not None:
        return rdrop_loss(logits, targets, rdrop_alpha)
    return _cross_entropy(logits, targets)


def _cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    # a sum over the counted targets: a micro-batch of prompt tokens only (instruction data)
    # gives 0, not cross_entropy's 0/0
    summed, count = _summed_cross_entropy(logits, targets)
    return summed / count.clamp(min=1)


def _summed_cross_entropy(logits: torch.Tensor, targets: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    count = (targets != IGNORE_INDEX).sum()
    summed = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")
    return full(summed), count


def summed_lm_loss(output: object, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of the next-token cross-entropy over the counted targets, their count): what an
    evaluation adds up over micro-batches and ranks before it divides, so that the mean is
    over tokens whatever the plan splits."""
    logits = logits_of(output)
    if not vocab_split(logits):
        logits = full(logits)
    return _summed_cross_entropy(logits, targets)


def classification_loss(output: object, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy (fp32) of a classifier's ``(batch, classes)`` logits against its
    integer labels; logits split over the classes stay split (``loss_parallel``), as the
    language model's over its vocabulary."""
    logits = logits_of(output)
    if not vocab_split(logits):
        logits = full(logits)
    return full(F.cross_entropy(logits.float(), labels))


def rdrop_loss(logits: torch.Tensor, targets: torch.Tensor, alpha: float) -> torch.Tensor:
    """R-Drop's loss for logits [2b, s, vocab] (rows ``b:`` a second pass of rows ``:b``):
    the two passes' mean cross-entropy plus ``alpha`` times their symmetric KL divergence,
    ``(KL(p1||p2) + KL(p2||p1)) / 2``, averaged over the trained targets (as the R-Drop
    authors' Hugging Face example weighs the two terms)."""
    rows = targets.shape[0]
    if logits.shape[0] != 2 * rows:
        raise ValueError(f"R-Drop expects logits for two passes of {rows} rows, got "
                         f"{logits.shape[0]}; is the model's R-Drop transform applied?")
    cross = _cross_entropy(logits, torch.cat([targets, targets]))
    log_p = _log_softmax(logits.float())
    first, second = log_p[:rows], log_p[rows:]
    # KL(p1||p2) + KL(p2||p1) = sum over the vocabulary of (p1 - p2)(log p1 - log p2)
    symmetric = full(((first.exp() - second.exp()) * (first - second)).sum(-1))
    counted = (targets != IGNORE_INDEX).to(symmetric.dtype)
    kl = (symmetric * counted).sum() / counted.sum().clamp(min=1) / 2
    return cross + alpha * kl


def _log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """log-softmax over the last dimension from plain reductions. Under ``loss_parallel``
    the log_softmax op's backward passes its gradient through unchanged (it assumes an NLL
    loss follows, whose backward does the rest), which is wrong for a KL term; sums and
    maxima over a split vocabulary reduce across the ranks with ordinary gradients."""
    shift = logits.detach().amax(dim=-1, keepdim=True)
    return logits - ((logits - shift).exp().sum(dim=-1, keepdim=True).log() + shift)


def context_parallel_lm_loss(cp: ContextParallel, output: object, targets: torch.Tensor
                             ) -> torch.Tensor:
    """The loss to back-propagate on this cp rank for its share of the targets: its summed
    next-token cross-entropy over the counted targets of the whole sequence (all cp ranks'),
    times cp, because the data-parallel gradient reduction over dp x cp averages where the
    tokens' loss adds up. ``cp.mean`` of it is the sequence's mean loss."""
    logits = logits_of(output)
    count = (targets != IGNORE_INDEX).sum()
    dist.all_reduce(count, group=cp.group)
    summed = full(F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(),
                                  reduction="sum"))
    return summed * cp.size / count.clamp(min=1)
