"""Every fine-tuning method learns: each fine-tunes a tiny Llama loaded from a local Hugging
Face checkpoint on a small synthetic task (one process), and its loss falls."""

from __future__ import annotations

import numpy as np
import pytest

import autopar
from autopar.codegen.program import generated_program
from autopar.data.dataset import TokenWriter
from autopar.models.source import describe_source
from autopar.train import Trainer

SEQ, BATCH, STEPS = 32, 8, 20
# (settings, learning rate): the usual rates of each method, scaled up for a 20-step run
METHODS = {
    "lora": ("method=lora,r=4,lora_alpha=8,target_modules=all-linear", 1e-2),
    "prefix_tuning": ("method=prefix_tuning,num_virtual_tokens=8", 1e-1),
    "adapter": ("method=adapter,adapter_size=16", 1e-2),
    "low_rank_adapter": ("method=low_rank_adapter,adapter_size=16,low_rank_rank=2", 1e-2),
    "bitfit": ("bitfit", 1e-2),
    "rdrop": ("method=rdrop,rdrop_alpha=1.0", 1e-3),
}


@pytest.fixture(scope="module")
def counting(tmp_path_factory) -> str:
    """Documents that count in steps of 1-3 over 16 of the 256 token ids: a method learns
    the 16 ids (biases suffice) and, with more capacity, the next one."""
    prefix = tmp_path_factory.mktemp("data") / "counting"
    rng = np.random.default_rng(0)
    with TokenWriter(prefix, 256) as writer:
        for _ in range(400):
            start, stride = rng.integers(0, 16), rng.integers(1, 4)
            writer.add_document(16 * ((start + stride * np.arange(2 * SEQ)) % 16))
    return str(prefix)


def test_the_methods_cover_the_issue() -> None:
    assert set(METHODS) == set(autopar.peft.METHODS)


@pytest.mark.parametrize("method", list(METHODS))
def test_every_method_learns(method: str, counting: str, hf_folder) -> None:
    peft, lr = METHODS[method]
    graph = autopar.capture("tiny-llama", seq=SEQ, peft=peft)
    plan = autopar.plan(graph, devices=1, global_batch=BATCH, task="finetune",
                        constraints=dict(precision="fp32", microbatch_size=BATCH,
                                         num_microbatches=1))
    source = describe_source("tiny-llama")
    trainer = Trainer(source, plan, program=generated_program(plan, source), data=counting,
                      init_from=str(hf_folder("tiny-llama")), lr=lr)
    trained = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    total = sum(1 for _ in trainer.model.parameters())
    assert trained and (len(trained) == total) == (method == "rdrop")  # only R-Drop trains all
    losses = trainer.train(STEPS)
    assert np.mean(losses[-3:]) < losses[0] - 0.15, losses


def test_frozen_weights_are_held_in_the_plans_parameter_dtype(counting: str, hf_folder) -> None:
    """In bf16 the frozen base needs no fp32 master copy: the generated program holds it in
    bf16 (what the planner prices), the adapters stay fp32, and it still learns."""
    graph = autopar.capture("tiny-llama", seq=SEQ, peft=METHODS["lora"][0])
    plan = autopar.plan(graph, devices=1, global_batch=BATCH, task="finetune",
                        constraints=dict(precision="bf16", microbatch_size=BATCH,
                                         num_microbatches=1))
    source = describe_source("tiny-llama")
    trainer = Trainer(source, plan, program=generated_program(plan, source), data=counting,
                      init_from=str(hf_folder("tiny-llama")), lr=METHODS["lora"][1])
    held = {(str(p.dtype), p.requires_grad) for p in trainer.model.parameters()}
    assert held == {("torch.bfloat16", False), ("torch.float32", True)}
    losses = trainer.train(STEPS)
    assert np.mean(losses[-3:]) < losses[0] - 0.15, losses
