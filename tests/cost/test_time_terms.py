"""Compute, communication and pipeline terms against hand-computed expectations."""

from __future__ import annotations

import pytest

from autopar.cost.comm import Link, axis_collective_time, axis_placement, ring_time
from autopar.cost.compute import matmul_efficiency, op_time
from autopar.cost.config import ParallelConfig
from autopar.cost.hardware import load_cluster
from autopar.cost.pipeline import pipeline_step_time
from autopar.ir.graph import OpKind, OpNode, TensorMeta

LINK = Link(bandwidth=100e9, latency=1e-5)


def test_ring_formulas() -> None:
    n, nbytes = 8, 1e9
    assert ring_time("all_reduce", nbytes, n, LINK) == pytest.approx(14e-5 + 2 * 7 / 8 * 1e-2)
    assert ring_time("all_gather", nbytes, n, LINK) == pytest.approx(7e-5 + 7 / 8 * 1e-2)
    assert ring_time("reduce_scatter", nbytes, n, LINK) == ring_time("all_gather", nbytes, n, LINK)
    assert ring_time("send_recv", nbytes, 2, LINK) == pytest.approx(1e-5 + 1e-2)
    assert ring_time("broadcast", nbytes, 8, LINK) == pytest.approx(3e-5 + 1e-2)
    assert ring_time("all_reduce", nbytes, 1, LINK) == 0.0
    with pytest.raises(ValueError):
        ring_time("gossip", 1, 2, LINK)


def test_axis_placement_tp_innermost() -> None:
    cfg = ParallelConfig(dp=16, tp=8, pp=2)
    assert axis_placement(cfg, "tp", 8).nodes == 1
    dp = axis_placement(cfg, "dp", 8)
    assert (dp.per_node, dp.nodes) == (1, 16)  # stride 8: every dp rank on its own node
    cfg = ParallelConfig(dp=16, tp=2)
    dp = axis_placement(cfg, "dp", 8)
    assert (dp.per_node, dp.nodes) == (4, 4)  # hierarchical


def test_links_chosen_by_placement() -> None:
    cluster = load_cluster("a100-80g")
    nbytes = 1e9
    intra = axis_collective_time("all_reduce", nbytes, ParallelConfig(tp=8), "tp", cluster)
    inter = axis_collective_time("all_reduce", nbytes, ParallelConfig(dp=8, tp=8), "dp", cluster)
    hier = axis_collective_time("all_reduce", nbytes, ParallelConfig(dp=16, tp=2), "dp", cluster)
    node, eff = cluster.node, cluster.device.efficiency.comm
    assert intra == pytest.approx(ring_time("all_reduce", nbytes, 8,
                                            Link(node.intra_bandwidth * eff, node.intra_latency)))
    assert inter == pytest.approx(ring_time("all_reduce", nbytes, 8,
                                            Link(node.inter_bandwidth * eff, node.inter_latency)))
    assert intra < hier < axis_collective_time("all_reduce", nbytes, ParallelConfig(dp=16, tp=8),
                                               "dp", cluster)


def _linear(m: int, n: int, k: int) -> OpNode:
    out = TensorMeta((m, n), "bfloat16")
    ins = [TensorMeta((m, k), "bfloat16"), TensorMeta((n, k), "bfloat16")]
    return OpNode("lin", "aten.linear.default", OpKind.LINEAR, ["x"], ins, [out], 2 * m * n * k,
                  sum(t.nbytes for t in ins), out.nbytes, ["w"])


def test_big_matmul_is_compute_bound_and_small_one_less_efficient() -> None:
    device = load_cluster("a100-80g").device
    big = _linear(8192, 8192, 8192)
    t = op_time(big, device, "bf16", 1.0, 1.0)
    eff = matmul_efficiency(device, 8192, 8192, 8192)
    assert t == pytest.approx(big.flops / (312e12 * eff))
    assert matmul_efficiency(device, 64, 8192, 8192) < 0.5 * eff
    # splitting over tp=4 divides the work
    assert op_time(big, device, "bf16", 1.0, 1.0, divisor=4) < t / 3.5


def test_elementwise_is_memory_bound() -> None:
    device = load_cluster("a100-80g").device
    x = TensorMeta((4096, 4096), "bfloat16")
    op = OpNode("add", "aten.add.Tensor", OpKind.ELEMENTWISE, ["a", "b"], [x, x], [x], x.numel,
                2 * x.nbytes, x.nbytes)
    expected = 3 * x.nbytes / (device.memory_bandwidth * device.efficiency.memory)
    assert op_time(op, device, "bf16", 1.0, 1.0) == pytest.approx(expected)


def test_pipeline_schedules() -> None:
    f, b, m, p = [1.0] * 4, [2.0] * 4, 8, 4
    gpipe, bubble = pipeline_step_time(f, b, m, "gpipe")
    assert gpipe == pytest.approx((m + p - 1) * 3.0) and bubble == pytest.approx(9.0)
    assert pipeline_step_time(f, b, m, "1f1b")[0] == gpipe
    inter, ib = pipeline_step_time(f, b, m, "interleaved", virtual_stages=3)
    assert ib == pytest.approx(9.0 / 3)
    zb, zbb = pipeline_step_time(f, b, m, "zero_bubble")
    assert zbb == pytest.approx(9.0 / 3)  # ZB-H1: a third of 1F1B's bubble when B = W = F
    one, none = pipeline_step_time([1.0], [2.0], m)
    assert one == 24.0 and none == 0.0
    slow, _ = pipeline_step_time([1.0, 2.0], [2.0, 4.0], 4)
    assert slow == pytest.approx(3 * 6.0 + 9.0)  # imbalance: bottleneck stage sets the pace
    with_p2p, b2 = pipeline_step_time(f, b, m, "1f1b", p2p_s=0.5)
    assert with_p2p - gpipe == pytest.approx(2 * 3 * 0.5)


def test_steady_state_sends_wait_without_overlap() -> None:
    """Hidden sends cost only the fill and drain; blocking ones (gloo on CPU) also stall every
    micro-batch's forward and backward, once per model chunk."""
    f, b, m, p2p = [1.0] * 4, [2.0] * 4, 8, 0.5
    hidden, _ = pipeline_step_time(f, b, m, "1f1b", p2p_s=p2p, p2p_hidden=1.0)
    blocking, bubble = pipeline_step_time(f, b, m, "1f1b", p2p_s=p2p, p2p_hidden=0.0)
    assert blocking - hidden == pytest.approx(2 * m * p2p)
    assert bubble == pytest.approx(9.0 + 2 * 3 * p2p + 2 * m * p2p)
    half, _ = pipeline_step_time(f, b, m, "1f1b", p2p_s=p2p, p2p_hidden=0.5)
    assert half - hidden == pytest.approx(m * p2p)
    inter, _ = pipeline_step_time(f, b, m, "interleaved", 2, p2p_s=p2p, p2p_hidden=0.0)
    inter_hidden, _ = pipeline_step_time(f, b, m, "interleaved", 2, p2p_s=p2p)
    assert inter - inter_hidden == pytest.approx(2 * 2 * m * p2p)
