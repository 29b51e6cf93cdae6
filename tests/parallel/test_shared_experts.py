"""Shared experts under expert parallelism: tiny Qwen2-MoE (a shared expert and its gate beside
the routed experts in every layer) trains under plans drawn from the search with ep2 as one
process does: every step's loss and every first-step gradient; the routed experts are split
over the ep ranks and the shared expert stays whole on each."""

from __future__ import annotations

import pytest

import autopar
from autopar.models.source import describe_source
from tests.fixtures.harness import differing_gradients, run_ranks

pytestmark = pytest.mark.dist
SEQ, BATCH, STEPS = 32, 4, 3
NAME = "tiny-qwen2-moe"


def _plan(devices: int, **pins):
    graph = autopar.capture(NAME, seq=SEQ)
    return autopar.plan(graph, devices=devices, global_batch=BATCH, cluster="a100-80g",
                        constraints=dict(pins, precision="fp32"))


def _split_parameters(trainer) -> dict:
    """Which parameters this rank holds only a part of over ep, by kind."""
    split = {"routed": 0, "shared": 0}
    for name, p in trainer.model.named_parameters():
        mesh = getattr(p, "device_mesh", None)
        if mesh is None or "ep" not in (mesh.mesh_dim_names or ()):
            continue
        if p.placements[mesh.mesh_dim_names.index("ep")].is_shard():
            split["shared" if "shared_expert" in name else "routed"] += 1
    return split


@pytest.fixture(scope="module")
def one_process() -> tuple:
    return run_ranks(describe_source(NAME), _plan(1, microbatch_size=1), STEPS,
                     first_grads=True)


@pytest.mark.parametrize("pins", [dict(ep=2, dp=1, tp=1, pp=1, cp=1),
                                  dict(ep=2, dp=2, tp=1, pp=1, cp=1, zero_stage=1)],
                         ids=["ep2", "ep2 x dp2 zero1"])
def test_shared_experts_under_expert_parallelism_equal_one_process(pins, one_process) -> None:
    ref_losses, _, ref_grads = one_process
    devices = pins["ep"] * pins["dp"]
    plan = _plan(devices, microbatch_size=1, **pins)
    assert all(plan.mesh.get(axis, 1) == degree for axis, degree in pins.items()
               if axis != "zero_stage")
    assert plan.zero_stage == pins.get("zero_stage", plan.zero_stage)
    losses, _, grads, split = run_ranks(describe_source(NAME), plan, STEPS, first_grads=True,
                                        probe=_split_parameters)
    assert losses == pytest.approx(ref_losses, abs=1e-4)
    assert losses[0] != losses[-1]
    # 4 layers' routed gate_up and down stacks split over ep; the shared expert whole
    assert split == {"routed": 8, "shared": 0}
    assert not differing_gradients(ref_grads, grads)
    assert any("shared_expert." in n for n in grads)
