"""Evaluation of the sharded model: the held-out loss equals one process's under tp2 x dp2
(the planner's full-size layout) and pp2 x dp2, after some training; a fine-tuning plan
evaluates with its adapters (fp32, gloo, CPU)."""

from __future__ import annotations

import math

import pytest

import autopar
from autopar.models.source import describe_source
from tests.fixtures.harness import run_ranks
from tests.fixtures.layouts import with_full_size_layout

pytestmark = pytest.mark.dist
STEPS, BATCH, SEQ = 2, 8, 32
LORA = "method=lora,r=4,lora_alpha=8,target_modules=all-linear"


def _held_out(trainer) -> dict:
    """Every rank evaluates (collectives inside); rank 0's record comes back."""
    from autopar.train.evaluate import HeldOut, evaluate

    return evaluate(trainer, HeldOut("synthetic", batches=2))


@pytest.fixture(scope="module")
def llama():
    return describe_source("tiny-llama"), autopar.capture("tiny-llama", seq=SEQ)


def _plan(graph, devices: int, task: str = "train", **pins):
    pins = dict(dict(pp=1, tp=1, dp=1, precision="fp32"), **pins)
    return autopar.plan(graph, devices=devices, global_batch=BATCH, task=task,
                        constraints=pins)


@pytest.fixture(scope="module")
def reference(llama):
    source, graph = llama
    return run_ranks(source, _plan(graph, 1, microbatch_size=2), STEPS, probe=_held_out)


CASES = {"tp2 x dp2": dict(tp=2, dp=2, zero_stage=3, microbatch_size=2,
                           sequence_parallel=False),
         "pp2 x dp2": dict(pp=2, dp=2, zero_stage=0, microbatch_size=1, schedule="1f1b")}


@pytest.mark.parametrize("case", list(CASES))
def test_held_out_loss_equals_one_process(llama, reference, case: str) -> None:
    source, graph = llama
    plan = _plan(graph, 4, **CASES[case])
    if plan.mesh["tp"] > 1:
        plan = with_full_size_layout(plan, "tiny-llama")
    losses, sharded, record = run_ranks(source, plan, STEPS, probe=_held_out)
    ref_losses, _, ref = reference
    assert losses == pytest.approx(ref_losses, rel=1e-4)
    # every held-out token once, whatever the plan splits: 2 batches of 8 rows x 32 targets
    assert record["tokens"] == ref["tokens"] == 2 * BATCH * SEQ
    assert record["loss"] == pytest.approx(ref["loss"], abs=1e-4)
    assert record["perplexity"] == pytest.approx(math.exp(record["loss"]), rel=1e-9)
    assert record["step"] == STEPS
    # held out: not the data the model trained on (random tokens: about log(vocab) each)
    assert abs(record["loss"] - ref_losses[-1]) > 1e-6
    if plan.mesh["tp"] > 1:
        assert sharded > 0


def test_fine_tuning_evaluates_with_its_adapters(hf_folder) -> None:
    """LoRA under dp2 from a Hugging Face checkpoint: the evaluation equals one process's,
    and differs from the base model's (the adapters trained away from B = 0)."""
    source = describe_source("tiny-llama")
    graph = autopar.capture("tiny-llama", seq=SEQ, peft=LORA)
    weights = str(hf_folder("tiny-llama"))
    one = run_ranks(source, _plan(graph, 1, "finetune", microbatch_size=4), 3,
                    probe=_held_out, init_from=weights)
    two = run_ranks(source, _plan(graph, 2, "finetune", dp=2, microbatch_size=2), 3,
                    probe=_held_out, init_from=weights)
    assert two[2]["loss"] == pytest.approx(one[2]["loss"], abs=1e-4)
    base_graph = autopar.capture("tiny-llama", seq=SEQ)
    untrained = run_ranks(source, _plan(base_graph, 1, microbatch_size=4), 0,
                          probe=_held_out, init_from=weights)
    assert abs(untrained[2]["loss"] - one[2]["loss"]) > 1e-4
