"""Megatron-Core runs a norm and a rotary embedding as one fused kernel each: the planner prices
what the engine launches, not the eager chain Hugging Face's modules capture into."""

from __future__ import annotations

from dataclasses import replace

import pytest

import autopar
from autopar.cost.activations import _kernel_saved, requires_grad, saved_tensors
from autopar.cost.block_cost import block_cost, cached_block_cost, resolve_precision
from autopar.cost.config import ParallelConfig
from autopar.cost.fused_regions import fused_regions, region_bytes
from autopar.cost.hardware import load_cluster
from autopar.ir.graph import OpKind


@pytest.fixture(scope="module")
def llama():
    return autopar.capture("tiny-llama", seq=256)


@pytest.fixture(scope="module")
def gpt2():
    return autopar.capture("tiny-gpt2", seq=256)


def test_each_rmsnorm_module_is_one_region_reading_x_and_writing_y(llama) -> None:
    block = llama.blocks[1]
    regions = fused_regions(llama, block)
    norms = [r for r in regions
             if all(llama.op(n).kind in (OpKind.NORM, OpKind.VIEW) for n in r)]
    assert len(norms) == 2  # input_layernorm and post_attention_layernorm
    for region in norms:
        assert len(region) >= 5  # upcast, square, mean, rsqrt, scale...: one kernel
        ins, outs = region_bytes(llama, block, region)
        first, last = llama.op(region[0]), llama.op(region[-1])
        # the bf16 input once (plus the small weight) and the bf16 output once: never the
        # fp32 intermediates
        assert first.input_meta[0].nbytes <= ins <= first.input_meta[0].nbytes * 1.01
        assert outs == pytest.approx(last.bytes_written)


def test_ops_with_a_sublayer_between_them_are_not_fused(gpt2) -> None:
    """GPT-2's two residual adds share a module, but the MLP runs between them."""
    block = gpt2.blocks[1]
    for region in fused_regions(gpt2, block):
        assert not all(gpt2.op(n).target.startswith("aten.add") for n in region)


def test_megatron_core_prices_a_llama_block_cheaper_than_op_by_op(llama) -> None:
    cluster = load_cluster("h100-80g")
    block = llama.blocks[1]
    base = resolve_precision(ParallelConfig(engine="megatron"), cluster)
    core = replace(base, engine="megatron-core")
    eager = block_cost(llama, block, base, cluster, "none")
    fused = block_cost(llama, block, core, cluster, "none")
    assert fused.fwd_s < eager.fwd_s and fused.bwd_s < eager.bwd_s
    # a fused kernel keeps what it reads from outside, never its intermediates
    assert fused.activation_bytes < eager.activation_bytes


def test_a_fused_rmsnorm_keeps_its_input_only(llama) -> None:
    """Eager, an RMSNorm keeps its fp32 upcast and its normalized copy; Transformer Engine's
    fused kernel keeps its input (and a per-row statistic)."""
    block = llama.blocks[1]
    grad_ops = requires_grad(llama)
    regions = fused_regions(llama, block)
    region_of = {n: k for k, r in enumerate(regions) for n in r}
    norms = [r for r in regions
             if all(llama.op(n).kind in (OpKind.NORM, OpKind.VIEW) for n in r)]
    for region in norms:
        eager, fused = set(), set()
        for name in region:
            saved = saved_tensors(llama, llama.op(name), grad_ops)
            eager |= {t.root for t in saved}
            fused |= {t.root for t in _kernel_saved(llama, llama.op(name), saved, region_of)}
        outside = {i for n in region for i in llama.op(n).inputs if i not in region}
        assert fused == outside and len(fused) == 1
        assert eager - fused  # the intermediates the eager chain keeps


def test_a_decomposed_tanh_gelu_is_one_region(gpt2) -> None:
    """GPT-2's "gelu_new" captures as eight eager kernels; Megatron runs one."""
    block = gpt2.blocks[1]
    regions = fused_regions(gpt2, block)
    assert len(regions) == 1
    assert {gpt2.op(n).module_path for n in regions[0]} == {"transformer.h.0.mlp.act"}
    ins, outs = region_bytes(gpt2, block, regions[0])
    act_in = gpt2.op(regions[0][0]).input_meta[0].nbytes
    assert ins == act_in and outs == pytest.approx(act_in)  # reads x once, writes gelu(x)


def test_the_block_cost_cache_keeps_engines_apart(llama) -> None:
    """One process plans the same block under both engines: each gets its own price."""
    cluster = load_cluster("h100-80g")
    base = ParallelConfig(engine="megatron")
    eager = cached_block_cost(llama, 1, base, cluster, "none")
    fused = cached_block_cost(llama, 1, replace(base, engine="megatron-core"), cluster, "none")
    assert fused.fwd_s < eager.fwd_s
