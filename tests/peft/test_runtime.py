"""LoRA fine-tuning runs as planned: from a local Hugging Face checkpoint, sharded under tp2
(the planner's full-size layout: A or B split with the base linear), dp2 ZeRO-3 and pp2, the
losses and the adapters' first-step gradients equal one process's (fp32, gloo, CPU)."""

from __future__ import annotations

import numpy as np
import pytest

import autopar
from autopar.runtime.source import describe_source

from ..runtime.harness import run_ranks
from ..runtime.layouts import with_full_size_layout

pytestmark = pytest.mark.dist
STEPS, BATCH, SEQ = 4, 4, 32
LORA = "method=lora,r=4,lora_alpha=8,target_modules=all-linear"


@pytest.fixture(scope="module")
def graph():
    return autopar.capture("tiny-llama", seq=SEQ, peft=LORA)


def _plan(graph, devices: int, peft: str = LORA, **pins):
    pins = dict(dict(pp=1, tp=1, dp=1, precision="fp32"), **pins)
    if pins["tp"] > 1:
        pins["sequence_parallel"] = False
    plan = autopar.plan(graph, devices=devices, global_batch=BATCH, task="finetune",
                        constraints=pins)
    if pins["tp"] > 1:
        plan = with_full_size_layout(plan, "tiny-llama", peft=peft)
    return plan


@pytest.fixture(scope="module")
def single(graph, hf_folder):
    plan = _plan(graph, 1, microbatch_size=2, num_microbatches=2)
    # one run: every step's loss, and the gradients the first optimizer step sees
    losses, _, grads = run_ranks(describe_source("tiny-llama"), plan, STEPS,
                                 init_from=str(hf_folder("tiny-llama")), first_grads=True)
    return losses, grads


CASES = {"tp2": dict(tp=2, microbatch_size=2, num_microbatches=2),
         "dp2 zero3": dict(dp=2, zero_stage=3, microbatch_size=1, num_microbatches=2),
         "pp2": dict(pp=2, microbatch_size=1, num_microbatches=4, schedule="1f1b")}


@pytest.mark.parametrize("case", list(CASES))
def test_lora_sharded_equals_one_process(graph, hf_folder, single, case: str) -> None:
    reference, reference_grads = single
    plan = _plan(graph, 2, **CASES[case])
    if plan.mesh["tp"] > 1:
        params = plan.placements["params"]
        assert params["model.layers.1.self_attn.q_proj.lora_B"].startswith("Shard(0)@tp")
        assert params["model.layers.1.mlp.down_proj.lora_A"].startswith("Shard(1)@tp")
    losses, _, grads = run_ranks(describe_source("tiny-llama"), plan, STEPS,
                                 init_from=str(hf_folder("tiny-llama")), first_grads=True)
    # only the adapters train: the base model's weights have no gradients
    assert grads.keys() == reference_grads.keys()
    assert grads and all(".lora_" in name for name in grads)
    for name, ref in reference_grads.items():
        assert np.linalg.norm(grads[name] - ref) <= 1e-4 * max(np.linalg.norm(ref), 1e-8), name
    assert losses == pytest.approx(reference, rel=1e-4)
    assert losses[-1] < losses[0]  # it learns


def _final_logits(trainer) -> dict:
    import torch

    ids = torch.randint(0, trainer.vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))
    return {"logits": trainer.logits(ids).numpy().copy(), "ids": ids.numpy().copy()}


def test_adapters_round_trip_through_peft(graph, hf_folder, tmp_path) -> None:
    """LoRA trained under tp2, exported as peft's adapter folder, loads into peft on the
    unsharded Hugging Face model with the same logits; --merge folds it into the weights."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from ..cli.test_inspect import run_cli

    art = tmp_path / "art"
    made = run_cli("compile", "tiny-llama", "--devices", "2", "--seq", str(SEQ), "--task",
                   "finetune", "--peft", LORA, "--cluster", "cpu", "--out", str(art), "-q")
    assert made.returncode == 0, made.stderr
    plan = _plan(graph, 2, **CASES["tp2"])
    *_, final = run_ranks(describe_source("tiny-llama"), plan, 3,
                          checkpoint_dir=str(art / "checkpoints"),
                          init_from=str(hf_folder("tiny-llama")), probe=_final_logits)
    adapter, merged = tmp_path / "adapter", tmp_path / "merged"
    assert run_cli("export", str(art), "--to", "hf", str(adapter)).returncode == 0
    assert sorted(p.name for p in adapter.iterdir()) == ["adapter_config.json",
                                                         "adapter_model.safetensors"]
    base = AutoModelForCausalLM.from_pretrained(hf_folder("tiny-llama"), dtype=torch.float32)
    model = PeftModel.from_pretrained(base, adapter)
    ids = torch.from_numpy(final["ids"])
    with torch.no_grad():
        np.testing.assert_allclose(model(ids).logits.numpy(), final["logits"], atol=1e-5)
    result = run_cli("export", str(art), "--to", "hf", str(merged), "--merge")
    assert result.returncode == 0, result.stderr
    folded = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)
    with torch.no_grad():
        np.testing.assert_allclose(folded(ids).logits.numpy(), final["logits"], atol=1e-5)


# the other methods that change the model: a bottleneck after attention and MLP (whole on
# every rank, reading the row-parallel projections' reduced outputs), its low-rank form, and
# BitFit's biases (split with a column-parallel linear)
_REFERENCES: dict[str, tuple] = {}
OTHER_METHODS = {"adapter": ("method=adapter,adapter_size=16", ["tp2", "pp2"]),
                 "low_rank_adapter": ("method=low_rank_adapter,adapter_size=16,low_rank_rank=2",
                                      ["tp2"]),
                 "bitfit": ("bitfit", ["tp2"])}


@pytest.mark.parametrize("method,case", [(m, c) for m, (_, cases) in OTHER_METHODS.items()
                                         for c in cases])
def test_other_methods_sharded_equal_one_process(hf_folder, method: str, case: str) -> None:
    peft = OTHER_METHODS[method][0]
    graph = autopar.capture("tiny-llama", seq=SEQ, peft=peft)
    source, folder = describe_source("tiny-llama"), str(hf_folder("tiny-llama"))
    if method not in _REFERENCES:  # one process, once per method
        one = _plan(graph, 1, peft=peft, microbatch_size=2, num_microbatches=2)
        _REFERENCES[method] = run_ranks(source, one, STEPS, init_from=folder,
                                        first_grads=True)
    reference, _, reference_grads = _REFERENCES[method]
    plan = _plan(graph, 2, peft=peft, **CASES[case])
    losses, _, grads = run_ranks(source, plan, STEPS, init_from=folder, first_grads=True)
    assert losses == pytest.approx(reference, rel=1e-4) and losses[-1] < losses[0]
    assert grads.keys() == reference_grads.keys() and grads
    for name, ref in reference_grads.items():
        assert np.linalg.norm(grads[name] - ref) <= 1e-4 * max(np.linalg.norm(ref), 1e-8), name
