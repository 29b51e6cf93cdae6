"""The training loop's hyperparameters: the learning rate the optimizer steps with equals the
schedule's formula at every step (also across a resume), weight decay skips biases and norms,
and bad settings are refused in one line."""

from __future__ import annotations

import math

import pytest

import autopar
from autopar.codegen import generated_program
from autopar.train import Trainer
from autopar.train.optim import Hyperparameters, decay_groups, lr_at


def _expected(step: int, lr: float, warmup: int, total: int, decay: str, floor: float) -> float:
    """The schedule as docs/runtime.md states it."""
    if step < warmup:
        return lr * (step + 1) / warmup
    p = min(max((step - warmup) / (total - warmup), 0.0), 1.0)
    if decay == "constant":
        return lr
    if decay == "linear":
        return lr - (lr - floor) * p
    return floor + (lr - floor) * 0.5 * (1 + math.cos(math.pi * p))


@pytest.mark.parametrize("decay", ["constant", "linear", "cosine"])
def test_schedule_formula_at_every_step(decay: str) -> None:
    hp = Hyperparameters(lr=3e-4, warmup_steps=5, decay=decay, decay_steps=40, min_lr=3e-5)
    got = [lr_at(hp, s) for s in range(50)]
    want = [_expected(s, 3e-4, 5, 40, decay, 3e-5) for s in range(50)]
    assert got == pytest.approx(want, rel=1e-12)
    assert got[4] == pytest.approx(3e-4)  # the warm-up ends at the peak
    if decay != "constant":
        assert got[40:] == pytest.approx([3e-5] * 10)  # past the horizon: the floor
        assert all(a >= b for a, b in zip(got[4:], got[5:], strict=False))  # never rises


@pytest.fixture(scope="module")
def gpt():
    from autopar.models import GPT, GPTConfig, token_inputs
    from autopar.models.source import describe_source

    cfg = GPTConfig(vocab_size=128, seq_len=16, d_model=32, n_layers=2, n_heads=4)
    model = GPT(cfg)
    graph = autopar.capture(model, token_inputs(1, cfg.seq_len))
    plan = autopar.plan(graph, devices=1, global_batch=4,
                        constraints=dict(microbatch_size=2, precision="fp32"))
    return describe_source(model), plan


def _trainer(gpt, hp: Hyperparameters) -> Trainer:
    source, plan = gpt
    return Trainer(source, plan, program=generated_program(plan, source), device="cpu",
                   hyper=hp)


def test_optimizer_steps_at_the_scheduled_rate_and_resumes_on_it(gpt, tmp_path) -> None:
    hp = Hyperparameters(lr=1e-2, warmup_steps=3, decay="cosine", min_lr=1e-3,
                         weight_decay=0.1, betas=(0.8, 0.95), eps=1e-7)
    trainer = _trainer(gpt, hp)
    seen = []
    step = trainer.optimizer.step

    def spy(*args, **kwargs):  # the rate each optimizer step really uses
        seen.append([g["lr"] for g in trainer.optimizer.param_groups])
        return step(*args, **kwargs)

    trainer.optimizer.step = spy
    trainer.train(6, checkpoint_dir=tmp_path)  # horizon: this run's 6 steps
    want = [_expected(s, 1e-2, 3, 6, "cosine", 1e-3) for s in range(6)]
    assert [lrs[0] for lrs in seen] == pytest.approx(want, rel=1e-12)
    assert all(len(set(lrs)) == 1 for lrs in seen)  # every group on one schedule
    group = trainer.optimizer.param_groups[0]
    assert (group["betas"], group["eps"]) == ((0.8, 0.95), 1e-7)
    # a resumed run continues the schedule it was given, past its horizon at the floor
    again = _trainer(gpt, hp)
    assert again.resume(tmp_path) == 6
    again.train(2)
    assert again.last_record["lr"] == pytest.approx(1e-3)
    assert again.horizon == 6


def test_weight_decay_skips_biases_and_norms(gpt) -> None:
    trainer = _trainer(gpt, Hyperparameters(weight_decay=0.1))
    groups = decay_groups(trainer.model, 0.1)
    decayed = {id(p) for p in groups[0]["params"]}
    for name, p in trainer.model.named_parameters():
        assert (id(p) in decayed) == (p.ndim >= 2), name
    assert [g["weight_decay"] for g in trainer.optimizer.param_groups] == [0.1, 0.0]
    assert sum(p.numel() for g in trainer.optimizer.param_groups for p in g["params"]) == \
        sum(p.numel() for p in trainer.model.parameters())


@pytest.mark.parametrize("bad, match", [
    (dict(decay="step"), "unknown learning-rate decay"),
    (dict(lr=-1e-3), "0 or more"),
    (dict(min_lr=1.0, lr=0.1), "min_lr within"),
    (dict(warmup_steps=10, decay_steps=5), "warm-up steps exceed"),
    (dict(betas=(1.0, 0.9)), "betas"),
])
def test_bad_settings_are_refused(bad: dict, match: str) -> None:
    with pytest.raises(autopar.PlanError, match=match):
        Hyperparameters(**bad)


def test_clip_norm_is_the_setting(gpt) -> None:
    trainer = _trainer(gpt, Hyperparameters(grad_clip=1e-6))
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train_step()
    moved = max(float((p.detach() - b).abs().max())
                for p, b in zip(trainer.model.parameters(), before, strict=True))
    # Adam normalises the clipped gradient, so the step is still about lr; what clipping
    # changes is the gradient the optimizer saw: its norm is the clip value
    state = trainer.optimizer.state
    norm = math.sqrt(sum(float(s["exp_avg"].pow(2).sum()) for s in state.values())) / 0.1
    assert norm == pytest.approx(1e-6, rel=1e-3)
    assert moved > 0
