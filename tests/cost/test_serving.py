"""The serving cost model: a decoding step is bound by reading weights and caches, prefill by
compute; checked against a public table of measured decode speeds."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

import autopar
from autopar.cost import ParallelConfig, estimate, load_cluster
from autopar.cost.block_cost import cached_block_cost, resolve_precision
from autopar.cost.estimate import stage_cost

TABLE = Path(__file__).resolve().parents[2] / "bench" / "data" / "decode_speeds.yaml"


@pytest.fixture(scope="module")
def llama8b():
    return autopar.capture("llama3-8b", seq=1024)


def _decode(graph, cluster="h100-80g", **kw):
    cluster = load_cluster(cluster)
    return estimate(graph, cluster, resolve_precision(ParallelConfig(**kw), cluster), "infer")


def test_public_decode_speeds_within_a_quarter() -> None:
    """gpt-fast's measured batch-1 Llama-2-7B decode speeds (tp 1-8, A100-80GB): the plan's
    predicted tokens/s lands within 25% of every row (bench/decode_speed_table.py prints all
    seven rows, 70B included)."""
    table = yaml.safe_load(TABLE.read_text())
    rows = [r for r in table["rows"] if r["config"] == "llama2-7b"]
    assert len(rows) == 4 and {r["tp"] for r in rows} == {1, 2, 4, 8}
    graph = autopar.capture("llama2-7b", seq=table["context"])
    for row in rows:
        plan = autopar.plan(graph, devices=row["tp"], cluster=table["cluster"], task="infer",
                            global_batch=1, constraints={"tp": row["tp"], "pp": 1})
        predicted = 1 / plan.predicted.decode_s_per_token
        assert abs(predicted / row["measured"] - 1) <= 0.25, (row, predicted)


def test_decoding_step_reads_every_weight(llama8b) -> None:
    device = load_cluster("h100-80g").device
    one = _decode(llama8b)
    weights = one.memory.params  # bf16 weights of the whole model on one device
    floor = weights / (device.memory_bandwidth * device.efficiency.memory)
    assert floor <= one.step_time_s <= 1.5 * floor  # bandwidth-bound, not compute-bound
    # eight sequences share one read of the weights: far less than eight steps
    eight = _decode(llama8b, microbatch_size=8)
    assert one.step_time_s < eight.step_time_s < 1.5 * one.step_time_s
    assert eight.tokens_per_s > 5 * one.tokens_per_s
    # prefill is compute: a 1024-token prompt is bound by its FLOPs, not by the weights
    peak = device.flops_for("bf16")
    assert one.prefill_s > llama8b.flops / peak > 2 * one.step_time_s


def test_longer_context_reads_more_cache() -> None:
    short = _decode(autopar.capture("llama3-8b", seq=512), microbatch_size=32)
    long = _decode(autopar.capture("llama3-8b", seq=4096), microbatch_size=32)
    assert long.memory.kv_cache == pytest.approx(8 * short.memory.kv_cache, rel=1e-6)
    # 32 caches of 4096 positions (17 GB) are read every step: slower than 512 positions
    device = load_cluster("h100-80g").device
    extra = (long.memory.kv_cache - short.memory.kv_cache) / (
        device.memory_bandwidth * device.efficiency.memory)
    assert long.step_time_s - short.step_time_s == pytest.approx(extra, rel=0.05)


def test_cache_splits_by_kv_heads_and_replicates_beyond_them(llama8b) -> None:
    """Llama-3-8B has 8 kv heads: tp=2 and tp=8 split each device's cache 2 and 8 ways; at
    tp=16 each rank holds the one kv head its query heads read, so it stays at an eighth."""
    caches = {}
    for tp in (1, 2, 8, 16):
        plan = autopar.plan(llama8b, devices=tp, cluster="h100-80g", task="infer",
                            global_batch=4, constraints={"tp": tp, "pp": 1})
        caches[tp] = plan.predicted.kv_cache_bytes
    assert caches[2] == pytest.approx(caches[1] / 2, rel=1e-5)  # the plan keeps 6 digits
    assert caches[8] == pytest.approx(caches[1] / 8, rel=1e-5)
    assert caches[16] == pytest.approx(caches[1] / 8, rel=1e-5)


def test_latent_attention_caches_its_latent_whole_on_every_rank() -> None:
    """DeepSeek-V2-Lite (MLA): a token's cache is one latent (512) and one rotary key (64) per
    layer, not 16 heads' keys (192) and values (128): 8.9x less. Tensor parallelism splits
    the heads but not the latent, so each rank holds it whole. Every step re-expands the
    cached latents (the up-projection over the whole context), which costs compute that
    grows with the context."""
    from autopar.cost.decode import block_decode_cost
    from autopar.ir.latent import decompressed_cache_width, latent_cache_width

    graph = autopar.capture("deepseek-v2-lite", seq=1024)
    cfg = graph.model_config
    width = latent_cache_width(cfg)
    assert width == 512 + 64 and decompressed_cache_width(cfg) / width == pytest.approx(8.89,
                                                                                      rel=1e-3)
    whole = cfg["num_hidden_layers"] * width * 2 * 8 * 1024  # bf16, 8 sequences of 1024
    for tp in (1, 2):
        plan = autopar.plan(graph, devices=tp, cluster="h100-80g", task="infer",
                            global_batch=8, constraints={"tp": tp, "pp": 1})
        assert plan.predicted.kv_cache_bytes == pytest.approx(whole, rel=1e-5)
    cluster = load_cluster("h100-80g")
    config = resolve_precision(ParallelConfig(), cluster)
    layer = graph.layer_blocks[1]
    short = block_decode_cost(graph, layer.index, config, cluster, 8, 128)
    long = block_decode_cost(graph, layer.index, config, cluster, 8, 1024)
    heads = cfg["num_attention_heads"]
    expand_flops = 2 * 8 * (1024 - 128) * cfg["kv_lora_rank"] * heads * (
        cfg["qk_nope_head_dim"] + cfg["v_head_dim"])
    assert long.compute_s - short.compute_s > expand_flops / cluster.device.flops_for("bf16")


def test_prefill_runs_forward_collectives_only(llama8b) -> None:
    """A forward-only pass all-reduces after each row-parallel linear, not for the backward's
    column inputs: half of what a training step's forward and backward price."""
    cluster = load_cluster("h100-80g")
    config = resolve_precision(ParallelConfig(tp=8), cluster)
    n = len(llama8b.blocks)
    prefill = stage_cost(llama8b, config, cluster, 0, (0, n), False)
    blocks = [cached_block_cost(llama8b, i, config, cluster, "none") for i in range(n)]
    assert prefill.comm_s == pytest.approx(sum(b.tp_fwd_comm_s for b in blocks))
    assert 0 < prefill.comm_s < 0.75 * sum(b.tp_comm_s for b in blocks)


def test_pipeline_stages_take_turns_on_micro_batches(llama8b) -> None:
    """Two stages, two micro-batches: each stage passes twice per step; one micro-batch would
    leave a stage idle while the other works."""
    two = _decode(llama8b, pp=2, microbatch_size=4, num_microbatches=2)
    one = _decode(llama8b, pp=2, microbatch_size=8, num_microbatches=1)
    assert two.bubble_s == pytest.approx(0.0, abs=1e-12)
    assert one.bubble_s > 0  # the hand-off and the other stage's pass
    passes = [s.fwd_s for s in two.stages]
    assert two.step_time_s == pytest.approx(2 * max(passes))
    # the same 8 sequences decode in one pass without stages (one read of the weights)
    flat = _decode(llama8b, microbatch_size=2, num_microbatches=4)
    whole = _decode(llama8b, microbatch_size=8)
    assert flat.step_time_s == pytest.approx(whole.step_time_s)
    # ... but prefilled two at a time: a quarter of the live activations, the same caches
    assert flat.memory.activations == pytest.approx(whole.memory.activations / 4, rel=0.01)
    assert flat.memory.kv_cache == pytest.approx(whole.memory.kv_cache)
