"""Offload priced as autopar's runtime runs it (FSDP2's CPUOffloadPolicy), with the host's
optimizer step on the cores and DRAM bandwidth the node's devices share."""

from __future__ import annotations

from dataclasses import replace

import pytest

import autopar
from autopar.cost.config import ParallelConfig
from autopar.cost.estimate import estimate
from autopar.cost.hardware import Cluster, load_cluster
from autopar.cost.memory import HOST_ADAMW_BYTES_PER_PARAM, host_optimizer_step_time


@pytest.fixture(scope="module")
def llama():
    return autopar.capture("tiny-llama", seq=64, batch=1)


def _est(graph, cluster="a100-80g", **kw):
    return estimate(graph, cluster, ParallelConfig(**kw))


def test_host_adamw_step_shares_the_hosts_dram_among_the_nodes_devices() -> None:
    """0.5e9 parameters per device, 8 A100s on one DGX A100 host: 80 bytes of DRAM traffic per
    parameter over an eighth of the host's bandwidth, about a second (not milliseconds)."""
    a100 = load_cluster("a100-80g")
    seconds = host_optimizer_step_time(0.5e9, a100)
    per_device = a100.node.host_memory_bandwidth / a100.node.devices_per_node
    assert seconds == pytest.approx(0.5e9 * HOST_ADAMW_BYTES_PER_PARAM / per_device)
    assert 0.5 < seconds < 3.0
    four = Cluster(device=a100.device, node=a100.node, devices_per_node=4)
    assert host_optimizer_step_time(0.5e9, four) == pytest.approx(seconds / 2)
    starved = replace(a100, node=replace(a100.node, host_cores=4))
    assert host_optimizer_step_time(0.5e9, starved) == pytest.approx(seconds * 2)


def test_optimizer_offload_is_priced_as_cpu_offload_policy(llama) -> None:
    """autopar's runtime offloads "optimizer" as CPUOffloadPolicy: parameters, gradients and
    optimizer states leave the device (it keeps only what it gathers), the host holds their
    shards, and the step pays the host's AdamW: the same plan as "optimizer+params"."""
    base = _est(llama, dp=2, zero_stage=2)
    opt = _est(llama, dp=2, zero_stage=2, offload=frozenset({"optimizer"}))
    both = _est(llama, dp=2, zero_stage=2, offload=frozenset({"optimizer", "params"}))
    assert opt.step_time_s == pytest.approx(both.step_time_s)
    assert opt.memory.total == pytest.approx(both.memory.total)
    assert opt.memory.params == opt.memory.grads == opt.memory.optimizer == 0.0
    assert opt.memory.total < base.memory.total
    assert opt.optimizer_s == 0.0 < base.optimizer_s  # the device no longer steps
    cluster = load_cluster("a100-80g")
    trained = llama.num_params / 2  # fully_shard's shard of every parameter
    host_step = host_optimizer_step_time(trained, cluster)
    assert opt.offload_s >= host_step > 0
    per_device = opt.host_bytes_per_node / cluster.devices_per_node
    # fp32 master (4) + gradient (4, reduced in fp32) + two moments (8) per shard element
    assert per_device == pytest.approx(trained * 16, rel=0.01)


def test_zero3_offload_streams_shards_twice_per_micro_batch(llama) -> None:
    """ZeRO-3 reshards after the forward: the backward gathers, and copies the shards up,
    again; more micro-batches stream more."""
    two = _est(llama, dp=2, zero_stage=2, num_microbatches=4,
               offload=frozenset({"optimizer"}))
    three = _est(llama, dp=2, zero_stage=3, num_microbatches=4,
                 offload=frozenset({"optimizer"}))
    fewer = _est(llama, dp=2, zero_stage=3, num_microbatches=2,
                 offload=frozenset({"optimizer"}))
    assert three.offload_s > two.offload_s
    assert three.offload_s > fewer.offload_s


def test_deepspeed_optimizer_offload_keeps_parameters_on_the_device(llama) -> None:
    """ZeRO-Offload (an exported DeepSpeed plan) moves the optimizer states and their step to
    the host and keeps the parameters and gradients on the device."""
    ds = _est(llama, dp=2, zero_stage=2, engine="deepspeed", offload=frozenset({"optimizer"}))
    assert ds.memory.optimizer == 0.0 and ds.memory.params > 0 and ds.memory.grads > 0
    assert ds.optimizer_s > 0 and ds.offload_s > 0
