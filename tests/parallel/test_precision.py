"""Precision as planned: bf16 compute (autocast, FSDP2's MixedPrecisionPolicy) with fp32
master weights, optimizer states and reductions, on CPU with gloo."""

from __future__ import annotations

import pytest

import autopar
from autopar.models.source import describe_source
from tests.fixtures.harness import run_ranks
from tests.fixtures.layouts import with_full_size_layout

pytestmark = pytest.mark.dist
STEPS = 20


def _plan(graph, devices: int, precision: str, **pins):
    return autopar.plan(graph, devices=devices, global_batch=8, cluster="cpu",
                        constraints=dict(pp=1, microbatch_size=4, precision=precision, **pins))


def _dtypes(trainer) -> dict:
    """What the step really computed in: the logits' dtype under the program's autocast, and
    the dtype of the parameters the optimizer updates (the master copy)."""
    import torch

    with trainer._compute():
        out = trainer.model(torch.zeros(1, 8, dtype=torch.long))
    logits = out.logits if hasattr(out, "logits") else out
    masters = {str(p.dtype) for p in trainer.optimizer.param_groups[0]["params"]}
    return {"logits": str(logits.dtype), "masters": sorted(masters)}


def test_bf16_follows_fp32_under_zero3_and_tp() -> None:
    graph, source = autopar.capture("tiny-llama", seq=32), describe_source("tiny-llama")
    fp32, _ = run_ranks(source, _plan(graph, 1, "fp32"), STEPS)
    zero3 = _plan(graph, 2, "bf16", dp=2, zero_stage=3)
    assert zero3.precision == {"param": "bf16", "compute": "bf16", "reduce": "fp32",
                               "loss_scaling": False}
    bf16_zero3, _, dtypes = run_ranks(source, zero3, STEPS, probe=_dtypes)
    assert dtypes == {"logits": "torch.bfloat16", "masters": ["torch.float32"]}
    tp = with_full_size_layout(_plan(graph, 2, "bf16", tp=2, dp=1, sequence_parallel=False),
                               "tiny-llama")
    bf16_tp, sharded = run_ranks(source, tp, STEPS)
    assert sharded > 0
    assert bf16_zero3 == pytest.approx(fp32, rel=0.02)
    assert bf16_tp == pytest.approx(fp32, rel=0.02)
    assert bf16_zero3 == pytest.approx(bf16_tp, rel=0.01)
    assert bf16_zero3 != pytest.approx(fp32, rel=1e-6)  # it really ran in bf16
    assert fp32[-1] < fp32[0]  # and it trains


@pytest.mark.parametrize("pins", [dict(pp=2, dp=1, tp=1, microbatch_size=2, schedule="1f1b"),
                                  dict(tp=2, dp=1, pp=1, microbatch_size=2,
                                       sequence_parallel=False)], ids=["pp2", "tp2"])
def test_fp16_with_loss_scaling_follows_fp32(pins: dict) -> None:
    """V100's precision: fp16 compute with dynamic loss scaling (one scale for the mesh: the
    first pipeline stage never sees the loss, tp mixes plain and DTensor gradients)."""
    graph, source = autopar.capture("tiny-llama", seq=32), describe_source("tiny-llama")
    fp32, _ = run_ranks(source, autopar.plan(graph, devices=1, global_batch=8, cluster="cpu",
                                             constraints=dict(microbatch_size=2,
                                                              precision="fp32")), 6)
    plan = autopar.plan(graph, devices=2, global_batch=8, cluster="cpu",
                        constraints=dict(pins, precision="fp16"))
    assert plan.precision["loss_scaling"]
    if pins["tp"] > 1:
        plan = with_full_size_layout(plan, "tiny-llama")
    fp16, _ = run_ranks(source, plan, 6)
    assert fp16 == pytest.approx(fp32, rel=0.02)


def test_an_overflow_skips_the_step_and_halves_the_scale() -> None:
    import torch

    from autopar.train.loss_scale import INIT_SCALE, LossScaler

    scaler = LossScaler(torch.device("cpu"))
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.tensor([INIT_SCALE, 2 * INIT_SCALE, 0.0])
    assert not scaler.unscale_([p]) and p.grad.tolist() == [1.0, 2.0, 0.0]
    p.grad = torch.tensor([1.0, float("inf"), 0.0])
    assert scaler.unscale_([p])
    scaler.update(True)
    assert scaler.value == INIT_SCALE / 2
