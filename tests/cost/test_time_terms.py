"""Compute, communication and pipeline terms against hand-computed expectations."""

from __future__ import annotations

import pytest

from autopar.cost.comm import Link, axis_collective_time, axis_placement, ring_time
from autopar.cost.compute import matmul_efficiency, op_backward_time, op_time
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


def _simple_ring(kind: str, nbytes: float, n: int, nodes: int, busbw: float,
                 cluster) -> float:
    """NCCL's Simple-protocol ring by hand (tuning.cc): start-up + per-step latencies, where
    2(N-1) (all_reduce) or N-1 (all_gather) steps cross the network, + bytes over busbw."""
    node = cluster.node
    steps, inter = (2 * (n - 1), 2 * (nodes - 1)) if kind == "all_reduce" else (n - 1, nodes - 1)
    volume = (2 if kind == "all_reduce" else 1) * (n - 1) / n * nbytes
    return (cluster.device.kernel_overhead_s + node.collective_latency
            + (steps - inter) * node.intra_latency + inter * node.inter_latency
            + volume / busbw)


def test_links_chosen_by_placement() -> None:
    cluster = load_cluster("a100-80g")
    node, nbytes = cluster.node, 1e9
    intra_bw = node.intra_bandwidth * node.intra_efficiency
    nic_bw = node.inter_bandwidth * node.inter_efficiency
    intra = axis_collective_time("all_reduce", nbytes, ParallelConfig(tp=8), "tp", cluster)
    assert intra == pytest.approx(_simple_ring("all_reduce", nbytes, 8, 1, intra_bw, cluster))
    # tp = 8 fills the node: each dp ring has one member per node and one NIC
    inter = axis_collective_time("all_reduce", nbytes, ParallelConfig(dp=8, tp=8), "dp", cluster)
    assert inter == pytest.approx(_simple_ring("all_reduce", nbytes, 8, 8, nic_bw, cluster))
    # four members per node drive four NICs: the ring's bus bandwidth is theirs together
    hier = axis_collective_time("all_gather", nbytes, ParallelConfig(dp=16, tp=2), "dp", cluster)
    assert hier == pytest.approx(_simple_ring("all_gather", nbytes, 16, 4, 4 * nic_bw, cluster))
    # a whole DGX A100 through its 8 HDR NICs: NCCL's measured 192 GB/s all_reduce bus bandwidth
    whole = ParallelConfig(dp=64)
    t = axis_collective_time("all_reduce", 8e9, whole, "dp", cluster)
    assert 2 * 63 / 64 * 8e9 / t == pytest.approx(192e9, rel=0.03)


def test_ring_latency_grows_with_ranks_and_the_tree_takes_over() -> None:
    """NCCL's own numbers (tuning.cc, post-2.23): a Simple ring all_gather over 1024 ranks on
    128 nodes starts 8.4 + 896 x 3.4 + 127 x 14 us = 4.83 ms late; small messages take the LL
    protocol and small all_reduces the tree."""
    cluster = load_cluster("a100-80g")
    config = ParallelConfig(dp=1024)
    big = axis_collective_time("all_gather", 16e9, config, "dp", cluster)
    nic = 8 * cluster.node.inter_bandwidth * cluster.node.inter_efficiency
    latency = big - 1023 / 1024 * 16e9 / nic - cluster.device.kernel_overhead_s
    assert latency == pytest.approx(4.83e-3, rel=0.01)
    small = axis_collective_time("all_gather", 1e5, config, "dp", cluster)
    ll = (6.6 + 896 * 0.6 + 127 * 2.7) * 1e-6  # the LL protocol's start-up and steps
    assert small < 1.2 * ll < latency
    ring_ar = _simple_ring("all_reduce", 1e5, 1024, 128, nic, cluster)
    tree_ar = axis_collective_time("all_reduce", 1e5, config, "dp", cluster)
    assert tree_ar < 0.2 * ring_ar  # log2(128) network steps instead of 254
    assert axis_collective_time("all_gather", 1e5, ParallelConfig(dp=64), "dp", cluster) < small


def test_matmul_waves_reproduce_measured_square_matmuls() -> None:
    """bf16 torch.matmul on H100 SXM (zzc0721/torch-performance-test-data#79): 177, 677, 789
    and 798 TFLOP/s at 1024^3 .. 8192^3 (one partial wave of 32 tiles at 1024). Each was
    timed as a short burst at boost clock, so it is priced as one (``sustained=False``)."""
    h100 = load_cluster("h100-80g").device
    for size, measured in ((1024, 176.62e12), (2048, 676.59e12), (4096, 788.72e12),
                           (8192, 797.51e12)):
        op = _linear(size, size, size)
        rate = op.flops / op_time(op, h100, "bf16", 1.0, 1.0, sustained=False)
        assert rate == pytest.approx(measured, rel=0.15), size


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
    assert t == pytest.approx(big.flops / (312e12 * eff) + device.kernel_overhead_s)
    assert matmul_efficiency(device, 64, 8192, 8192) < 0.5 * eff
    # splitting over tp=4 divides the work
    assert op_time(big, device, "bf16", 1.0, 1.0, divisor=4) < t / 3.5


def test_elementwise_is_memory_bound() -> None:
    device = load_cluster("a100-80g").device
    x = TensorMeta((4096, 4096), "bfloat16")
    op = OpNode("add", "aten.add.Tensor", OpKind.ELEMENTWISE, ["a", "b"], [x, x], [x], x.numel,
                2 * x.nbytes, x.nbytes)
    expected = 3 * x.nbytes / (device.memory_bandwidth * device.efficiency.memory)
    assert op_time(op, device, "bf16", 1.0, 1.0) == pytest.approx(
        expected + device.kernel_overhead_s)


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


def _sdpa(batch: int, heads: int, seq: int, dim: int) -> OpNode:
    q = TensorMeta((batch, heads, seq, dim), "bfloat16")
    flops = 4 * batch * heads * seq * seq * dim  # the IR's count: the full score matrix
    return OpNode("sdpa", "aten.scaled_dot_product_attention.default", OpKind.ATTENTION,
                  ["q", "k", "v"], [q, q, q], [q], flops, 3 * q.nbytes, q.nbytes)


def test_fused_attention_priced_as_the_kernel_runs() -> None:
    """A causal flash kernel does half the IR's FLOPs; its backward does 2.5x the forward's
    at the backward rate; short sequences run below the long-sequence rate."""
    device = load_cluster("a100-80g").device
    eff = device.efficiency
    op = _sdpa(1, 32, 16384, 128)
    fwd = op_time(op, device, "bf16", 1.0, 1.0) - device.kernel_overhead_s
    keys = 16384 / 2
    ramp = keys / (keys + eff.attention_ramp_tokens)
    assert fwd == pytest.approx(op.flops / 2 / (312e12 * eff.attention_forward * eff.sustained
                                                * ramp))
    bwd = op_backward_time(op, device, "bf16", 1.0, 1.0) - device.kernel_overhead_s
    assert bwd / fwd == pytest.approx(2.5 * eff.attention_forward / eff.attention_backward)
    short = _sdpa(32, 32, 512, 128)  # the same FLOPs over shorter sequences
    short_fwd = op_time(short, device, "bf16", 1.0, 1.0) - device.kernel_overhead_s
    assert short_fwd > 1.3 * fwd * short.flops / op.flops


def test_backward_matmuls_at_their_own_shapes_and_frozen_weights_skip_one() -> None:
    device = load_cluster("h100-80g").device
    big = _linear(8192, 8192, 8192)
    fwd = op_time(big, device, "bf16", 1.0, 1.0)
    assert op_backward_time(big, device, "bf16", 1.0, 1.0) == pytest.approx(2 * fwd, rel=0.01)
    frozen = op_backward_time(big, device, "bf16", 1.0, 1.0, weight_grad=False)
    assert frozen == pytest.approx(fwd, rel=0.01)
    # 64 tokens x 8192 outputs: one partial wave forward; the weight gradient (8192 x 8192
    # output, reducing over the 64 tokens) fills the device
    skinny = _linear(64, 8192, 8192)
    assert op_backward_time(skinny, device, "bf16", 1.0, 1.0) < 2 * op_time(
        skinny, device, "bf16", 1.0, 1.0)


def test_sustained_clock_and_dispatch_floor() -> None:
    device = load_cluster("h100-80g").device
    big = _linear(8192, 8192, 8192)
    burst = op_time(big, device, "bf16", 1.0, 1.0, sustained=False)
    sustained = op_time(big, device, "bf16", 1.0, 1.0)
    assert sustained / burst == pytest.approx(1 / device.efficiency.sustained, rel=0.01)
    x = TensorMeta((8, 64), "bfloat16")  # a tiny kernel waits on the host that issues it
    tiny = OpNode("gelu", "aten.gelu.default", OpKind.ELEMENTWISE, ["a"], [x], [x], x.numel,
                  x.nbytes, x.nbytes)
    assert op_time(tiny, device, "bf16", 1.0, 1.0) == device.dispatch_overhead_s > 0


def test_memory_bound_backward_moves_what_autograd_moves() -> None:
    device = load_cluster("a100-80g").device
    bandwidth = device.memory_bandwidth * device.efficiency.memory
    x = TensorMeta((4096, 4096), "bfloat16")
    gelu = OpNode("gelu", "aten.gelu.default", OpKind.ELEMENTWISE, ["a"], [x], [x], x.numel,
                  x.nbytes, x.nbytes)
    # reads the output gradient and the saved input, writes the input gradient
    assert op_backward_time(gelu, device, "bf16", 1.0, 1.0) == pytest.approx(
        3 * x.nbytes / bandwidth + device.kernel_overhead_s)
    add = OpNode("add", "aten.add.Tensor", OpKind.ELEMENTWISE, ["a", "b"], [x, x], [x], x.numel,
                 2 * x.nbytes, x.nbytes)
    assert op_backward_time(add, device, "bf16", 1.0, 1.0) == 0.0  # the gradient passes through
    mul = OpNode("mul", "aten.mul.Tensor", OpKind.ELEMENTWISE, ["a", "b"], [x, x], [x], x.numel,
                 2 * x.nbytes, x.nbytes)
    # one kernel per operand: output gradient x the other operand
    assert op_backward_time(mul, device, "bf16", 1.0, 1.0) == pytest.approx(
        6 * x.nbytes / bandwidth + 2 * device.kernel_overhead_s)
    mask = TensorMeta((4096, 4096), "bool")
    both = OpNode("and", "aten.__and__.Tensor", OpKind.ELEMENTWISE, ["a", "b"], [mask, mask],
                  [mask], mask.numel, 2 * mask.nbytes, mask.nbytes)
    assert op_backward_time(both, device, "bf16", 1.0, 1.0) == 0.0
