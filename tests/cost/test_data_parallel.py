"""Data-parallel communication: overlap as it behaves, per-block collectives, per engine."""

from __future__ import annotations

import pytest

import autopar
from autopar.cost import ParallelConfig, estimate, load_cluster
from autopar.cost.data_parallel import (
    StepSync,
    backward_with_collectives,
    forward_with_gathers,
    overlapped,
    step_sync_exposed,
)
from autopar.cost.hardware import Overlap

GPU = Overlap(concurrent=1.0, compute_slowdown=0.2)
SHARED = Overlap(concurrent=0.5, compute_slowdown=0.2)


def test_only_part_hides_and_what_hides_slows_compute() -> None:
    assert overlapped(10.0, 0.0, GPU) == 10.0
    assert overlapped(10.0, 4.0, GPU) == pytest.approx(10.0 + 0.2 * 4.0)  # hidden, but slows
    assert overlapped(4.0, 10.0, GPU) == pytest.approx(10.0 + 0.2 * 4.0)  # comm-bound
    # half runs beside compute: the rest is exposed
    assert overlapped(10.0, 4.0, SHARED) == pytest.approx(10.0 + 0.2 * 2.0 + 2.0)
    serial = Overlap(concurrent=0.0, compute_slowdown=0.2)
    assert overlapped(10.0, 4.0, serial) == 14.0
    # never faster than either alone, never slower than both in turn
    for c, x in ((1.0, 3.0), (3.0, 1.0), (2.0, 2.0)):
        for ov in (GPU, SHARED, serial):
            assert max(c, x) <= overlapped(c, x, ov) <= c + x


def test_per_block_gathers_prefetch_one_ahead() -> None:
    c, g, r = [3.0, 3.0, 3.0], [1.0, 1.0, 1.0], [2.0, 2.0, 2.0]
    # forward: the first gather exposed, each next one beside the current block
    assert forward_with_gathers(c, g, GPU) == pytest.approx(1.0 + 2 * (3.0 + 0.2) + 3.0)
    # backward: the last block's gather exposed; beside each block the previous block's
    # gather and the reduce-scatter just finished; the first block's reduce-scatter exposed
    expected = 1.0 + overlapped(3.0, 1.0, GPU) + overlapped(3.0, 3.0, GPU) \
        + overlapped(3.0, 2.0, GPU) + 2.0
    assert backward_with_collectives(c, g, r, GPU) == pytest.approx(expected)
    # collectives longer than the compute set the pace
    slow = forward_with_gathers([1.0] * 4, [5.0] * 4, GPU)
    assert slow == pytest.approx(5.0 + 3 * (5.0 + 0.2) + 1.0)


def test_megatron_reduces_after_the_backward_autopar_beside_it() -> None:
    sync = StepSync(grad_s=4.0, grad_last_s=0.5, grad_overlaps=True, param_s=1.0)
    beside = step_sync_exposed(sync, 10.0, GPU)
    assert beside == pytest.approx(0.2 * 3.5 + 0.5 + 1.0)
    after = step_sync_exposed(StepSync(4.0, 0.5, False, 1.0), 10.0, GPU)
    assert after == 5.0


def test_zero3_throughput_falls_as_sequences_per_gpu_shrink() -> None:
    """GPT-3 175B under ZeRO-3 alone at a global batch of 1536: from 4 to 1 sequences per GPU
    each block's gathers stay the same size while its compute shrinks, so per-GPU throughput
    falls (it was predicted flat when overlap was taken as perfect)."""
    graph = autopar.capture("gpt3-175b", seq=2048)
    rates = []
    for devices, mb in ((384, 4), (768, 2), (1536, 1)):
        config = ParallelConfig(dp=devices, zero_stage=3, microbatch_size=mb, recompute="full")
        est = estimate(graph, "a100-80g", config)
        rates.append(est.model_flops / est.step_time_s / devices)
    assert rates[0] > rates[1] > rates[2]
    assert rates[2] < 0.9 * rates[0]


def test_the_robustness_checks_slow_collectives_and_halve_overlap() -> None:
    cluster = load_cluster("a100-80g")
    slow = cluster.perturbed(comm_slower=1.5)
    assert slow.node.inter_bandwidth == pytest.approx(cluster.node.inter_bandwidth / 1.5)
    assert slow.node.intra_latency == pytest.approx(cluster.node.intra_latency * 1.5)
    half = cluster.perturbed(overlap_scale=0.5)
    assert half.device.overlap.concurrent == pytest.approx(0.5)
    graph = autopar.capture("tiny-llama", seq=64)
    config = ParallelConfig(dp=64, zero_stage=3)
    base = estimate(graph, cluster, config).step_time_s
    assert estimate(graph, slow, config).step_time_s > base
    assert estimate(graph, half, config).step_time_s > base
