"""Offload runs as it is priced: the host bytes the cost model predicts for a plan are the
bytes the runtime really keeps on the host after ``autopar.parallelize`` (two gloo ranks)."""

from __future__ import annotations

import pytest
import torch

import autopar
from autopar.cost.memory import host_states
from autopar.parallel import policies as runtime
from tests.fixtures.harness import run_in_group, spawn_ranks

BATCH = 4


def _probe_loop(rank: int, port: int, out, world: int, plan_dict: dict) -> None:
    run_in_group(rank, port, out, world, _placement, plan_dict)


def _placement(plan_dict: dict) -> dict:
    """Where this rank's parameters live after parallelize: the bytes of the shards that
    fully_shard holds under CPUOffloadPolicy (on the host, stepped there), and all of them."""
    import torch
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule

    from autopar.models import build_model
    from autopar.plan import Plan

    torch.manual_seed(0)
    plan = Plan.from_dict(plan_dict)
    model = autopar.parallelize(build_model("tiny-llama", device="cpu", dtype=torch.float32),
                                plan)
    host = 0
    seen = set()
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        group = module._get_fsdp_state()._fsdp_param_group
        if group is None or not isinstance(group.offload_policy, CPUOffloadPolicy):
            continue
        for p in group.fsdp_params:
            if id(p) not in seen:  # FSDPParam objects live as long as the model
                seen.add(id(p))
                local = p.sharded_param.to_local()
                host += local.numel() * local.element_size()
    total = sum(p.numel() for p in model.parameters()) * 4
    return {"host_param_bytes": host, "total_param_bytes": total}


@pytest.fixture(scope="module")
def llama_graph():
    return autopar.capture("tiny-llama", seq=16)


@pytest.mark.parametrize("offload", [["optimizer"], []])
def test_host_bytes_priced_are_the_bytes_the_runtime_offloads(llama_graph, offload) -> None:
    """A planner-drawn 2-rank ZeRO-2 plan: the host states the cost model names for its
    offload (parameters, gradients, optimizer states for "optimizer", as FSDP2's
    CPUOffloadPolicy holds them) match where the runtime's parameter shards live, byte for
    byte; nothing is priced on the device that the runtime keeps on the host."""
    plan = autopar.plan(llama_graph, devices=2, global_batch=BATCH, cluster="cpu",
                        constraints=dict(dp=2, tp=1, pp=1, zero_stage=2, microbatch_size=1,
                                         offload=offload or "none", precision="fp32"))
    assert sorted(plan.offload) == offload
    placed = spawn_ranks(_probe_loop, 2, (2, plan.to_dict()))[0]
    stage = plan.predicted.stages[0]
    states = host_states(frozenset(plan.offload), plan.engine)
    if not offload:
        assert states == frozenset() and placed["host_param_bytes"] == 0
        assert stage["host_bytes"] == 0
        return
    assert states == {"params", "grads", "optimizer"}
    # fp32 AdamW: a parameter (4 bytes), its gradient (4) and two moments (8) per element
    assert stage["host_bytes"] == pytest.approx(placed["host_param_bytes"] * 16 / 4, rel=0.02)
    assert placed["host_param_bytes"] == pytest.approx(placed["total_param_bytes"] / 2,
                                                       rel=0.02)
    mem = stage["memory"]
    assert mem["params"] == mem["grads"] == mem["optimizer"] == 0.0
    assert plan.predicted.offload_s > 0  # the shards' streams and the host's AdamW step


def test_an_offloading_rank_takes_its_share_of_the_host_cores(monkeypatch) -> None:
    """The host step is priced on the node's cores shared by its devices: a rank started with
    one thread (torchrun's default) takes cores // local ranks, never fewer than it has."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        monkeypatch.setattr(runtime.os, "cpu_count", lambda: 8)
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
        assert runtime.use_host_cores() == 2
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "16")
        assert runtime.use_host_cores() == 2  # never fewer than it has
    finally:
        torch.set_num_threads(before)
