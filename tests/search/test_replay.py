"""A plan's recorded choice, priced again: the cost model gives back the plan's own
prediction, so a recalibrated profile can re-price exactly the plan that ran."""

from __future__ import annotations

import pytest

import autopar
from autopar.cost.estimate import estimate
from autopar.search.replay import plan_config

# (model, devices, pins, global batch): tensor-parallel layouts chosen by the solver (kv
# heads replicated at tp=8, fused projections), pipelines, experts, ZeRO
CASES = [("llama3-8b", 8, {"tp": 8}, 64), ("tiny-llama", 4, {"tp": 2, "pp": 2}, 8),
         ("phi3-mini", 8, {"tp": 4}, 64), ("tiny-gpt2", 4, {"tp": 2, "dp": 2}, 8),
         ("mixtral-8x7b", 64, {}, 512), ("gemma-2b", 8, {"tp": 8}, 64)]


@pytest.mark.parametrize("name, devices, pins, batch", CASES)
def test_replayed_plan_prices_as_planned(name, devices, pins, batch) -> None:
    graph = autopar.capture(name)
    plan = autopar.plan(graph, devices=devices, global_batch=batch, constraints=pins or None)
    again = estimate(graph, plan.cluster, plan_config(plan, graph))
    assert again.step_time_s == pytest.approx(plan.predicted.step_time_s, rel=1e-5)
    assert again.memory.total == pytest.approx(plan.predicted.memory["total"], rel=1e-5)
    if plan.mesh["tp"] > 1:  # the recorded layout, not a default one
        assert plan_config(plan, graph).tp_layouts is not None


def test_a_plan_of_another_model_is_refused() -> None:
    plan = autopar.plan("tiny-llama", devices=2, global_batch=4, constraints={"tp": 2})
    with pytest.raises(autopar.PlanError, match="capture the model the plan was made for"):
        plan_config(plan, autopar.capture("tiny-gpt2"))
