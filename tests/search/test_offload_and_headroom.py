"""The shipped Llama-3-8B/70B and Mixtral-8x7B at 8 and 64 devices (default cluster,
default global batch): offload only where nothing fits without it, then priced with the host's
optimizer step; memory within the usable memory (which sets the allocator's fragmentation
aside), and a plan above 95% of it only when nothing leaner is near, with the report saying so."""

from __future__ import annotations

import pytest

import autopar
from autopar.cost.hardware import load_cluster
from autopar.cost.memory import host_optimizer_step_time
from autopar.report.summary import memory_warning
from autopar.search.robust import MEMORY_RISK_FRACTION

MODELS = ("llama3-8b", "llama3-70b", "mixtral-8x7b")
DEVICES = (8, 64)


class _Lazy(dict):
    """Captures or plans a key on first use: each test pays (and is timed for) only the
    searches it reads first, and the module's tests share them."""

    def __init__(self, make, keys) -> None:
        super().__init__()
        self._make, self._keys = make, list(keys)

    def __missing__(self, key):
        self[key] = value = self._make(key)
        return value

    def items(self):
        for key in self._keys:
            self[key]  # noqa: B018 - made on first use
        return super().items()


@pytest.fixture(scope="module")
def graphs() -> dict:
    return _Lazy(autopar.capture, MODELS)


@pytest.fixture(scope="module")
def plans(graphs) -> dict:
    return _Lazy(lambda key: autopar.plan(graphs[key[0]], devices=key[1]),
                 [(name, devices) for name in MODELS for devices in DEVICES])


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("devices", DEVICES)
def test_offload_only_where_nothing_fits_without_it(graphs, plans, name, devices) -> None:
    plan = plans[(name, devices)]
    if not plan.offload:
        return
    with pytest.raises(autopar.InfeasibleError):
        autopar.plan(graphs[name], devices=devices, constraints={"offload": "none"})
    # priced with the host's AdamW step over the shard of the states the host holds
    cluster = load_cluster(plan.cluster)
    host_per_device = plan.predicted.host_bytes_per_node / cluster.devices_per_node
    trained = host_per_device / 16  # fp32 master, fp32 gradient, two fp32 moments
    assert plan.predicted.offload_s >= host_optimizer_step_time(trained, cluster) > 0.1
    assert plan.predicted.memory["optimizer"] == 0.0


def test_the_shipped_plans_offload_only_the_models_that_need_it(plans) -> None:
    """8 A100-80G cannot hold 70B's or Mixtral's states (16 bytes per parameter) even fully
    sharded; 64 can, and 8B never needs the host."""
    offloaded = sorted(key for key, plan in plans.items() if plan.offload)
    assert offloaded == [("llama3-70b", 8), ("mixtral-8x7b", 8)]


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("devices", DEVICES)
def test_memory_within_the_headroom(plans, name, devices) -> None:
    plan = plans[(name, devices)]
    device = load_cluster(plan.cluster).device
    assert plan.memory_limit_bytes == pytest.approx(device.usable_memory_bytes, rel=1e-6)
    assert plan.memory_limit_bytes <= device.memory_bytes * device.usable_fraction * (
        1 - device.allocator_fragmentation) * (1 + 1e-6)
    share = plan.predicted.memory["total"] / plan.memory_limit_bytes
    assert share <= 1.0
    robust = plan.solver["robust"]
    assert robust["memory_risk"] == (share > MEMORY_RISK_FRACTION)
    assert (memory_warning(plan) is not None) == (share > MEMORY_RISK_FRACTION)
    # the search prices each mesh's partition at the allocator's margin too, so a lean plan
    # near the fastest exists at every one of these budgets: none is taken at risk
    assert not robust["memory_risk"]


def test_a_mesh_that_fills_memory_competes_with_its_lean_partition(plans) -> None:
    """Llama-3-70B on 64 devices: the fastest plan fills the usable memory (its mesh's fastest
    recompute split), the chosen one keeps the 5% margin for a little more recompute."""
    robust = plans[("llama3-70b", 64)].solver["robust"]
    assert robust["fastest_memory_fraction"] > MEMORY_RISK_FRACTION
    assert robust["memory_fraction"] <= MEMORY_RISK_FRACTION
    assert robust["passed_over_for_memory"] > 0


def test_robust_choice_passes_over_plans_without_memory_headroom(graphs) -> None:
    """Llama-3-8B on 8 devices, 256 sequences: plans within 3% of the fastest use up to ~99%
    of the memory; the search takes one within 95% of it instead, and says so. (On 16 devices
    the fastest plans now keep headroom: the fused attention's output is no longer counted
    twice, so that setting no longer exercises the choice.)"""
    plan = autopar.plan(graphs["llama3-8b"], devices=8, global_batch=256)
    assert not plan.offload  # the host's AdamW step (about 2 s for 1e9 params) is priced
    robust = plan.solver["robust"]
    assert robust["passed_over_for_memory"] > 0 and not robust["memory_risk"]
    assert plan.predicted.memory["total"] <= MEMORY_RISK_FRACTION * plan.memory_limit_bytes
    assert plan.predicted.step_time_s <= robust["fastest_step_time_s"] * (1 + robust["margin"])
    assert memory_warning(plan) is None
    assert "passed over for using more than" in plan.report(fmt="text")
