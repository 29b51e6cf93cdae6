"""The search proposes no tensor-parallel layout that does not run: layers that run from their
own graph are split as planned and executed on meta before a plan is returned."""

from __future__ import annotations

import pytest

import autopar
from autopar.capture.layer_split import Refused, Split, view_split
from autopar.search.verify_tp import tensor_parallel_refusal
from tests.fixtures.plain_models import make_gpt, make_head_biased_gpt, make_vit

FP32 = dict(precision="fp32", sequence_parallel=False)


@pytest.mark.parametrize("make", [make_gpt, make_vit], ids=["fused-qkv-gpt", "vit-mha"])
def test_plans_whose_split_runs_keep_tensor_parallelism(make) -> None:
    model, example = make()
    plan = autopar.plan(model, example, devices=2, global_batch=4, constraints=dict(FP32, tp=2))
    assert plan.mesh["tp"] == 2
    assert tensor_parallel_refusal(model, example, plan) is None
    assert "tensor_parallel_refused" not in plan.solver


def test_a_split_that_does_not_run_is_never_proposed() -> None:
    model, example = make_head_biased_gpt()
    plan = autopar.plan(model, example, devices=4, global_batch=4, constraints=dict(FP32, dp=2))
    assert plan.mesh["tp"] == 1 and plan.mesh["dp"] == 2
    reason = plan.solver["tensor_parallel_refused"]
    assert "attention mask per head" in reason
    assert "was not proposed" in plan.report() and "attention mask per head" in plan.report()


def test_sequence_parallelism_is_not_proposed_for_layers_run_from_their_graph() -> None:
    model, example = make_gpt()
    plan = autopar.plan(model, example, devices=2, global_batch=4,
                        constraints=dict(precision="fp32", tp=2))
    assert plan.mesh["tp"] == 2 and not plan.sequence_parallel
    with pytest.raises(autopar.PlanError, match="sequence_parallel=True does not run"):
        autopar.plan(model, example, devices=2, global_batch=4,
                     constraints=dict(precision="fp32", tp=2, sequence_parallel=True))


def test_a_pinned_split_that_does_not_run_is_one_line() -> None:
    model, example = make_head_biased_gpt()
    with pytest.raises(autopar.PlanError) as err:
        autopar.plan(model, example, devices=2, global_batch=4, constraints=dict(FP32, tp=2))
    assert "tp=2 does not run on this model" in str(err.value)
    assert "\n" not in str(err.value)


def test_views_follow_the_split_by_place_value() -> None:
    # nn.MultiheadAttention: (seq, batch, heads*dim) -> (seq, batch*heads, dim): the heads
    # land inside the merged dimension, batch-major
    split = view_split(Split(2, factor=64), (17, 2, 64), (17, 8, 16), 2)
    assert split == Split(1, prefix=2, factor=4, suffix=1)
    # heads and head size merged back: a contiguous block of the features
    assert view_split(Split(2, factor=4), (17, 2, 4, 16), (34, 64), 2) == \
        Split(1, prefix=1, factor=4, suffix=16)
    # fused q, k, v side by side: the parts count leads, each part split
    assert view_split(Split(2, prefix=3, factor=64), (17, 1, 192), (17, 1, 3, 64), 2) == \
        Split(3, factor=64)
    # a contiguous split of the fused output cannot become q, k and v
    with pytest.raises(Refused):
        view_split(Split(2, factor=192), (17, 1, 192), (17, 1, 3, 64), 2)
