"""Stop, resume under a different plan, continue: the uninterrupted losses."""

from __future__ import annotations

import pytest

import autopar
from autopar.models import GPT, GPTConfig, token_inputs
from autopar.runtime.checkpoint import latest_checkpoint
from autopar.runtime.source import describe_source

from .harness import run_ranks
from .test_equivalence import _megatron, _plan

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def gpt():
    cfg = GPTConfig(vocab_size=128, seq_len=32, d_model=64, n_layers=2, n_heads=4)
    model = GPT(cfg)
    return describe_source(model), autopar.capture(model, token_inputs(1, cfg.seq_len))


def test_resume_under_another_plan_continues_the_same_losses(gpt, tmp_path) -> None:
    source, graph = gpt
    reference, _ = run_ranks(source, _plan(graph, 1, microbatch_size=2), steps=6)
    ckpt = str(tmp_path / "ckpt")
    first, _ = run_ranks(source, _plan(graph, 2, dp=2, zero_stage=3, microbatch_size=1),
                         steps=4, checkpoint_dir=ckpt)
    assert latest_checkpoint(ckpt).name == "step_000004"
    assert not list((tmp_path / "ckpt").glob("*.partial"))
    tp_plan = _megatron(_plan(graph, 2, tp=2, dp=1, microbatch_size=2, sequence_parallel=False),
                        ("qkv", "fc"),
                        ("attn.proj", "mlp.proj"))
    rest, sharded = run_ranks(source, tp_plan, steps=2, checkpoint_dir=ckpt, resume=True)
    assert sharded > 0
    assert first + rest == pytest.approx(reference, rel=1e-4)


def test_checkpoint_of_another_model_is_refused(gpt, tmp_path) -> None:
    source, graph = gpt
    ckpt = str(tmp_path / "ckpt")
    run_ranks(source, _plan(graph, 1, microbatch_size=2), steps=1, checkpoint_dir=ckpt)
    other = GPT(GPTConfig(vocab_size=128, seq_len=32, d_model=64, n_layers=3, n_heads=4))
    other_graph = autopar.capture(other, token_inputs(1, 32))
    with pytest.raises(RuntimeError, match="of another model"):
        run_ranks(describe_source(other), _plan(other_graph, 1, microbatch_size=2), steps=1,
                  checkpoint_dir=ckpt, resume=True)
    assert latest_checkpoint(ckpt).name == "step_000001"  # untouched
