"""Hugging Face checkpoints into any plan: every rank reads only its slices, and the sharded
model's logits equal the unsharded Hugging Face model's (fp32, gloo, CPU)."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

import autopar
from autopar.runtime.source import describe_source

from .harness import run_ranks
from .layouts import with_full_size_layout

pytestmark = pytest.mark.dist
SEQ, BATCH = 32, 4


def _ids(vocab: int, rows: int) -> torch.Tensor:
    return torch.randint(0, vocab, (rows, SEQ), generator=torch.Generator().manual_seed(7))


def _logits_probe(trainer, rows: int) -> dict:
    """On every rank: the model's logits for a fixed batch, and what this rank read."""
    out = trainer.logits(_ids(trainer.vocab, rows))
    return dict(logits=out.numpy().copy(), read=trainer.weights.bytes_read,
                local=trainer.init_report.local_bytes)


def _hf_logits(folder, rows: int) -> np.ndarray:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        return model(_ids(model.config.vocab_size, rows)).logits.numpy()


CASES = {"tp2": dict(tp=2), "pp2": dict(pp=2, num_microbatches=2, microbatch_size=2),
         "dp2 zero3": dict(dp=2, zero_stage=3), "ep2": dict(ep=2, zero_stage=0)}
MODELS = {"tiny-llama": ["tp2", "pp2", "dp2 zero3"], "tiny-gpt2": ["tp2", "pp2", "dp2 zero3"],
          "tiny-qwen2-moe": ["tp2", "pp2", "dp2 zero3", "ep2"]}


def _plan(name: str, pins: dict):
    pins = dict(dict(pp=1, tp=1, dp=1, ep=1, precision="fp32"), **pins)
    if pins["tp"] > 1:
        pins["sequence_parallel"] = False
    graph = autopar.capture(name, seq=SEQ)
    plan = autopar.plan(graph, devices=2, global_batch=BATCH, constraints=pins)
    if pins["tp"] > 1:  # the layout the planner picks for the full-size sibling
        plan = with_full_size_layout(plan, name)
    return plan


@pytest.mark.parametrize("name,case", [(n, c) for n, cases in MODELS.items() for c in cases])
def test_sharded_loading_gives_the_unsharded_logits(hf_folder, name: str, case: str) -> None:
    folder = hf_folder(name)
    plan = _plan(name, CASES[case])
    rows = plan.num_microbatches * plan.microbatch_size if plan.mesh["pp"] > 1 else BATCH
    *_, got = run_ranks(describe_source(name), plan, 0, init_from=str(folder),
                        probe=functools.partial(_logits_probe, rows=rows))
    expected = _hf_logits(folder, rows)
    np.testing.assert_allclose(got["logits"], expected, atol=1e-5, rtol=0)
    # rank 0 read its slices, not the model: at most its own bytes (+ replicated norms)
    total = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    assert got["read"] <= got["local"] + 1024
    if case != "dp2 zero3" or name != "tiny-gpt2":
        assert got["read"] < total
