"""FP8 training priced as Transformer Engine runs it: only the linears' GEMMs in FP8, at the
FP8 GEMM efficiency; attention and memory-bound ops in bf16; a cast (+ transpose) per GEMM
operand."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

import autopar
from autopar._paths import data_dir
from autopar.cost.block_cost import fp8_cast_time, resolve_precision
from autopar.cost.compute import (
    FP8_CAST_BYTES_PER_ELEMENT,
    kernel_dtype,
    op_backward_time,
    op_time,
)
from autopar.cost.config import ParallelConfig
from autopar.cost.hardware import load_cluster
from autopar.cost.precision import Precision
from autopar.cost.tp_layout import tp_layout
from autopar.ir.graph import OpKind, OpNode, TensorMeta

FP8 = Precision("bf16", "fp8", "fp32")


def linear_op(m: int, n: int, k: int) -> OpNode:
    out = TensorMeta((m, n), "bfloat16")
    ins = [TensorMeta((m, k), "bfloat16"), TensorMeta((n, k), "bfloat16")]
    return OpNode("lin", "aten.linear.default", OpKind.LINEAR, ["x"], ins, [out], 2 * m * n * k,
                  sum(t.nbytes for t in ins), out.nbytes, ["w"])


def sdpa_op(batch: int, heads: int, seq: int, dim: int) -> OpNode:
    q = TensorMeta((batch, heads, seq, dim), "bfloat16")
    return OpNode("sdpa", "aten.scaled_dot_product_attention.default", OpKind.ATTENTION,
                  ["q", "k", "v"], [q, q, q], [q], 4 * batch * heads * seq * seq * dim,
                  3 * q.nbytes, q.nbytes)


def test_every_shipped_catalog_with_fp8_states_its_fp8_gemm_efficiency() -> None:
    for path in sorted(Path(data_dir("cost_models")).glob("*.yaml")):
        device = yaml.safe_load(path.read_text())["device"]
        if "fp8" in device["tensor_core_dtypes"]:
            assert "matmul_fp8" in device["efficiency"], path.name
            cluster = load_cluster(path.stem)
            assert cluster.device.efficiency.matmul_for("fp8") == device["efficiency"][
                "matmul_fp8"]


def test_fp8_linear_is_less_than_twice_as_fast_as_bf16() -> None:
    """A big GEMM gains the FP8 peak (2x) times the FP8 / bf16 best-shape efficiency."""
    h100 = load_cluster("h100-80g").device
    eff = h100.efficiency
    op = linear_op(8192, 8192, 8192)
    bf16 = op_time(op, h100, "bf16", 1.0, 1.0) - h100.kernel_overhead_s
    fp8 = op_time(op, h100, "fp8", 1.0, 1.0) - h100.kernel_overhead_s
    expected = (h100.flops_for("fp8") * eff.matmul_fp8) / (h100.flops_for("bf16") * eff.matmul)
    assert bf16 / fp8 == pytest.approx(expected, rel=1e-6)
    assert 1.0 < bf16 / fp8 < 2.0


def test_attention_and_memory_bound_ops_stay_in_bf16_under_fp8() -> None:
    h100 = load_cluster("h100-80g").device
    attention = sdpa_op(1, 32, 4096, 128)
    x = TensorMeta((4096, 4096), "bfloat16")
    norm = OpNode("n", "aten.mul.Tensor", OpKind.NORM, ["a", "b"], [x, x], [x], x.numel,
                  2 * x.nbytes, x.nbytes)
    for op in (attention, norm):
        assert kernel_dtype(op, "fp8") == "bf16"
        assert op_time(op, h100, "fp8", 1.0, 1.0) == op_time(op, h100, "bf16", 1.0, 1.0)
        assert op_backward_time(op, h100, "fp8", 1.0, 1.0) == \
            op_backward_time(op, h100, "bf16", 1.0, 1.0)
    assert kernel_dtype(linear_op(64, 64, 64), "fp8") == "fp8"
    assert FP8.activation_bytes == 2  # activations are kept in bf16


def test_fp8_casts_priced_per_distinct_linear_input_and_output_gradient() -> None:
    graph = autopar.capture("gpt2", seq=128)
    cluster = load_cluster("h100-80g")
    config = resolve_precision(ParallelConfig(precision=FP8), cluster)
    block = graph.blocks[1]
    layout = tp_layout(graph, block, config.tp_layouts)
    fwd, bwd = fp8_cast_time(graph, block, layout, 1, 1.0, cluster)
    linears = [graph.op(n) for n in block.nodes if graph.op(n).kind is OpKind.LINEAR]
    assert linears
    distinct_inputs = {op.inputs[0]: op.input_meta[0].numel for op in linears}
    bandwidth = cluster.device.memory_bandwidth * cluster.device.efficiency.memory
    floor = cluster.device.dispatch_overhead_s
    per = [max(n * FP8_CAST_BYTES_PER_ELEMENT / bandwidth + cluster.device.kernel_overhead_s,
               floor) for n in distinct_inputs.values()]
    assert fwd == pytest.approx(sum(per))
    assert bwd > 0 and len(distinct_inputs) <= len(linears)


def test_fp8_plan_is_faster_than_bf16_but_not_twice() -> None:
    graph = autopar.capture("gpt2", seq=1024)
    pins = {"tp": 1, "pp": 1, "dp": 8, "microbatch_size": 8, "recompute": "none",
            "zero_stage": 1}
    step = {}
    for name, precision in (("bf16", "bf16"), ("fp8", FP8.as_dict())):
        plan = autopar.plan(graph, devices=8, cluster="h100-80g", global_batch=64,
                            constraints={**pins, "precision": precision})
        step[name] = plan.predicted.step_time_s
    assert step["fp8"] < step["bf16"] < 2 * step["fp8"]


def test_inputs_only_fp8_linears_save_are_kept_in_one_byte() -> None:
    """Transformer Engine saves an FP8 linear's input quantized (column-wise only): the
    tensors only linears save (a projection's input, SwiGLU's product before the down
    projection) halve under FP8; what attention, norms and activations save stays bf16, so
    the layer keeps more than half of its bf16 bytes."""
    from autopar.cost.activations import block_activation_bytes, requires_grad, saved_tensors
    from autopar.cost.compute import kernel_dtype

    graph = autopar.capture("tiny-llama", seq=64)
    layer = next(b for b in graph.blocks if b.role == "layer")
    bf16 = block_activation_bytes(graph, layer).stored_bytes
    fp8 = block_activation_bytes(graph, layer, fp8=True).stored_bytes
    grad_ops = requires_grad(graph)
    savers: dict = {}
    for name in layer.nodes:
        op = graph.op(name)
        for t in saved_tensors(graph, op, grad_ops):
            savers.setdefault((t.root, t.index), []).append((op, t.nbytes))
    only_linear = sum(entries[0][1] for entries in savers.values()
                      if all(kernel_dtype(op, "fp8") == "fp8" for op, _ in entries))
    assert only_linear > 0
    assert fp8 == pytest.approx(bf16 - only_linear / 2, rel=1e-6)
    assert bf16 / 2 < fp8 < bf16
