"""Non-language models in the Trainer: the task read from the plan (autopar.train.task), a
classifier's synthetic samples and loss, and the plain ViT (tests/fixtures/plain_models.py)
trained by the generated program under ZeRO, recompute and pipelines equal to one process.
(tp2, tp2 x dp2 and pp2 x tp2: tests/parallel/test_graph_tp.py.)"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import autopar
from autopar.errors import PlanError
from autopar.train.loss import classification_loss
from autopar.train.task import (
    CLASSIFICATION,
    LANGUAGE_MODEL,
    SyntheticSamples,
    open_samples,
    synthetic_samples,
    training_task,
)
from tests.fixtures.harness import run_ranks
from tests.fixtures.plain_models import make_gpt, make_vit

BATCH, STEPS = 4, 3
VIT = {"kind": "factory", "spec": "tests.fixtures.plain_models:make_vit"}


@pytest.fixture(scope="module")
def graphs() -> dict:
    """The captured GPT and ViT (planning from a graph skips the capture each time)."""
    return {name: autopar.capture(*factory()) for name, factory in
            (("gpt", make_gpt), ("vit", make_vit))}


def _plan(graph, devices: int = 1, **pins):
    return autopar.plan(graph, devices=devices, global_batch=BATCH,
                        constraints=dict(pins, precision="fp32"))


def test_the_task_is_read_from_the_captured_inputs_and_output(graphs) -> None:
    gpt, vit = _plan(graphs["gpt"]), _plan(graphs["vit"])
    assert gpt.model["input_dtypes"] == {"idx": "int64"}
    assert training_task(gpt).kind == LANGUAGE_MODEL
    task = training_task(vit)
    assert (task.kind, task.sample_shape, task.classes) == (CLASSIFICATION, (3, 16, 16), 10)
    assert vit.model["input_dtypes"] == {"images": "float32"}
    # a plan written before input dtypes were recorded trained a language model
    gpt.model = dataclasses.replace(gpt.model, input_dtypes=None)
    assert training_task(gpt).kind == LANGUAGE_MODEL


@pytest.mark.parametrize("dtype,output,seen", [
    ("int64", [1, 10], "idx int64 [1, 32] and returns [1, 10]"),  # token ids to classes
    ("float32", [1, 32, 128], "idx float32 [1, 32] and returns [1, 32, 128]"),
])
def test_any_other_task_is_refused_in_one_line(graphs, dtype, output, seen) -> None:
    plan = _plan(graphs["gpt"])
    plan.model = dataclasses.replace(plan.model, input_dtypes={"idx": dtype},
                                     outputs={"out": output})
    with pytest.raises(PlanError) as err:
        training_task(plan)
    message = str(err.value)
    assert "\n" not in message and seen in message
    assert "language models" in message and "classifiers" in message


def test_synthetic_samples_are_one_global_batch_whatever_the_rows_read() -> None:
    inputs, labels = synthetic_samples(2, 7, 8, (3, 4, 4), 10)
    assert inputs.shape == (8, 3, 4, 4) and inputs.dtype == torch.float32
    assert labels.dtype == torch.int64 and 0 <= int(labels.min()) and int(labels.max()) < 10
    source = SyntheticSamples((3, 4, 4), 10)
    halves = [source.rows(2, 8, 7, start, 4) for start in (0, 4)]
    assert torch.equal(torch.cat([h[0] for h in halves]), inputs)
    assert torch.equal(torch.cat([h[1] for h in halves]), labels)
    other = synthetic_samples(3, 7, 8, (3, 4, 4), 10)  # another step: another batch
    assert not torch.equal(other[0], inputs)
    with pytest.raises(ValueError):
        source.rows(0, 8, 7, 6, 4)


def test_a_classifier_trains_on_synthetic_samples_only(graphs) -> None:
    task = training_task(_plan(graphs["vit"]))
    with pytest.raises(PlanError, match="drop --data"):
        open_samples("corpus/train", task)


def test_classification_loss_is_the_mean_cross_entropy() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 10, generator=g, requires_grad=True)
    labels = torch.randint(0, 10, (6,), generator=g)
    want = torch.nn.functional.cross_entropy(logits, labels)
    got = classification_loss((logits,), labels)
    torch.testing.assert_close(got, want)


def test_tensors_no_init_rule_writes_take_the_constructors_values() -> None:
    """The ViT's bare class-token and position parameters and nn.MultiheadAttention's packed
    projection have no reset_parameters: from meta they take what the factory's constructor
    wrote (built once on CPU, same seed); without that build they are refused."""
    from autopar.models.source import build_from_source
    from autopar.parallel.init import materialize

    built = []

    def constructed() -> torch.nn.Module:
        built.append(build_from_source(VIT, 3, "cpu"))
        return built[-1]

    model = build_from_source(VIT, 3, "meta")
    materialize(model, 3, constructed=constructed)
    assert len(built) == 1  # once, however many tensors need it
    whole = dict(built[0].named_parameters())
    for name in ("pos", "layers.0.self_attn.in_proj_weight"):
        torch.testing.assert_close(model.get_parameter(name), whole[name], rtol=0, atol=0)
    assert float(model.get_parameter("pos").detach().std()) > 0
    with pytest.raises(PlanError, match="cannot initialise"):
        materialize(build_from_source(VIT, 3, "meta"), 3)


@pytest.mark.dist
@pytest.mark.parametrize("devices,pins", [(2, dict(dp=2, zero_stage=3)),
                                          (2, dict(tp=2, recompute="full")),
                                          (4, dict(pp=2, dp=2, schedule="1f1b"))],
                         ids=["zero3", "tp2-recompute", "pp2xdp2"])
def test_the_vit_trains_like_one_process_under_every_mode(graphs, devices, pins) -> None:
    """Losses over the steps and every first-step gradient of the program autopar generates
    equal one process's (the same synthetic images and labels, each dp rank its rows)."""
    plan = _plan(graphs["vit"], devices, **pins)
    assert all(plan.mesh[k] == v for k, v in pins.items() if k in plan.mesh)
    assert plan.zero_stage == pins.get("zero_stage", plan.zero_stage)
    assert "full" in plan.recompute if "recompute" in pins else True
    single = _plan(graphs["vit"], microbatch_size=plan.microbatch_size)
    want = run_ranks(VIT, single, steps=STEPS, first_grads=True)
    got = run_ranks(VIT, plan, steps=STEPS, first_grads=True)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-4, atol=1e-5)
    assert got[0][0] != got[0][-1]  # it trains
    assert set(got[2]) == set(want[2])
    for key, value in want[2].items():
        np.testing.assert_allclose(got[2][key], value, rtol=1e-4, atol=1e-5, err_msg=key)
    if plan.mesh["tp"] > 1 or plan.zero_stage == 3:
        assert got[1] > 0  # weights really are split
