"""The loss: R-Drop's two-pass loss on logits split over the vocabulary equals the whole-logits
loss (value and gradient, 2 gloo ranks), and a micro-batch with no trained target adds zero,
not NaN."""

from __future__ import annotations

import pytest
import torch

from autopar.train.loss import IGNORE_INDEX, lm_loss, rdrop_loss
from tests.fixtures.harness import run_in_group, spawn_ranks

ROWS, SEQ, VOCAB, ALPHA = 2, 5, 8, 4.0


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2 * ROWS, SEQ, VOCAB, generator=g)
    targets = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
    targets[0, :2] = IGNORE_INDEX  # prompt tokens: neither cross-entropy nor KL counts them
    return logits, targets


def _reference() -> tuple[float, torch.Tensor]:
    """R-Drop written out from its definition, on whole logits."""
    logits, targets = _inputs()
    logits.requires_grad_(True)
    counted = targets != IGNORE_INDEX
    first, second = logits[:ROWS], logits[ROWS:]
    ce = torch.nn.functional.cross_entropy
    cross = (ce(first[counted], targets[counted]) + ce(second[counted], targets[counted])) / 2
    p, q = first.log_softmax(-1), second.log_softmax(-1)
    kl_pq = (p.exp() * (p - q)).sum(-1)[counted].mean()
    kl_qp = (q.exp() * (q - p)).sum(-1)[counted].mean()
    loss = cross + ALPHA * (kl_pq + kl_qp) / 2
    loss.backward()
    return float(loss.detach()), logits.grad


def _vocab_parallel() -> tuple[float, torch.Tensor]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import loss_parallel

    mesh = init_device_mesh("cpu", (2,))
    logits, targets = _inputs()
    split = distribute_tensor(logits, mesh, [Shard(2)]).detach().requires_grad_(True)
    with loss_parallel():
        loss = rdrop_loss(split, targets, ALPHA)
        loss.backward()
    # numpy pickles by value: a tensor would travel as shared memory
    return float(loss.detach()), split.grad.full_tensor().numpy().copy()


def _rank(rank: int, port: int, out, world: int) -> None:
    run_in_group(rank, port, out, world, _vocab_parallel)


def test_rdrop_loss_is_its_definition() -> None:
    expected, expected_grad = _reference()
    logits, targets = _inputs()
    logits.requires_grad_(True)
    loss = rdrop_loss(logits, targets, ALPHA)
    loss.backward()
    assert float(loss) == pytest.approx(expected, rel=1e-6)
    torch.testing.assert_close(logits.grad, expected_grad)
    with pytest.raises(ValueError, match="two passes"):
        rdrop_loss(logits[:ROWS], targets, ALPHA)


@pytest.mark.dist
def test_rdrop_loss_vocab_parallel_equals_whole() -> None:
    expected, expected_grad = _reference()
    (value, grad), = spawn_ranks(_rank, 2, (2,), timeout_s=120)
    assert value == pytest.approx(expected, rel=1e-6)
    torch.testing.assert_close(torch.from_numpy(grad), expected_grad)


def test_a_micro_batch_of_prompt_tokens_adds_zero() -> None:
    logits = torch.randn(2, SEQ, VOCAB, requires_grad=True)
    targets = torch.full((2, SEQ), IGNORE_INDEX)
    loss = lm_loss(logits, targets)
    loss.backward()
    assert float(loss) == 0.0 and torch.all(logits.grad == 0)
    twice = torch.randn(4, SEQ, VOCAB, requires_grad=True)
    assert float(lm_loss(twice, targets, rdrop_alpha=ALPHA)) == 0.0
