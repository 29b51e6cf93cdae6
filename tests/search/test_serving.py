"""The serving planner: the fastest decoding step that fits, a latency bound traded for
throughput, and an InfeasibleError that says what would fit."""

from __future__ import annotations

import re

import pytest

import autopar
from autopar.cost import load_cluster
from autopar.errors import InfeasibleError


@pytest.fixture(scope="module")
def llama8b():
    return autopar.capture("llama3-8b", seq=2048)


def _serve(graph, **kw):
    kw.setdefault("cluster", "h100-80g")
    return autopar.plan(graph, task="infer", **kw)


def test_no_pinned_mesh_decodes_faster(llama8b) -> None:
    plan = _serve(llama8b, devices=8, global_batch=16)
    assert plan.predicted.decode_s_per_token == plan.predicted.step_time_s > 0
    assert plan.predicted.tokens_per_s == pytest.approx(16 / plan.predicted.step_time_s,
                                                        rel=1e-5)
    assert plan.zero_stage == 0 and set(plan.recompute) == {"none"}
    assert plan.predicted.memory["grads"] == plan.predicted.memory["optimizer"] == 0
    seen = 0
    for tp in (1, 2, 4, 8):
        for pp in (1, 2, 4, 8):
            if tp * pp > 8:
                continue
            pins = {"tp": tp, "pp": pp, "dp": 8 // (tp * pp)}
            other = _serve(llama8b, devices=8, global_batch=16, constraints=pins)
            seen += 1
            # the choice is the fastest, up to the robustness margin (3%)
            assert other.predicted.step_time_s >= plan.predicted.step_time_s / 1.03, pins
    assert seen == 10


def test_latency_bound_buys_the_most_throughput(llama8b) -> None:
    alone = _serve(llama8b, devices=8, global_batch=1).predicted.step_time_s
    bound_ms = 1.5 * alone * 1e3
    plan = _serve(llama8b, devices=8, global_batch=256, max_token_latency_ms=bound_ms)
    assert plan.predicted.step_time_s * 1e3 <= bound_ms
    assert 1 < plan.global_batch <= 256
    # every other concurrency tried is slower than the bound or yields fewer tokens/s
    for n in (1, 2, 4, 8, 16, 32, 64, 128, 256):
        if n == plan.global_batch:
            continue
        try:
            other = _serve(llama8b, devices=8, global_batch=n)
        except InfeasibleError:
            continue
        if other.predicted.step_time_s * 1e3 <= bound_ms:
            assert other.predicted.tokens_per_s <= plan.predicted.tokens_per_s * (1 + 1e-6)
    with pytest.raises(InfeasibleError, match=r"decodes within 0\.01 ms per token.*fastest "
                                              r"takes"):
        _serve(llama8b, devices=8, global_batch=16, max_token_latency_ms=0.01)
    with pytest.raises(autopar.PlanError, match="needs task='infer'"):
        autopar.plan(llama8b, devices=8, max_token_latency_ms=10)


def test_too_many_sequences_says_what_fits(llama8b) -> None:
    """One H100 holds Llama-3-8B's weights (16 GB) and the caches of about two hundred
    2048-token sequences; a thousand do not fit, and the error says how many do."""
    with pytest.raises(InfeasibleError) as err:
        _serve(llama8b, devices=1, global_batch=1024)
    message = str(err.value)
    assert "\n" not in message and "KV cache" in message and "weights" in message
    fit = int(re.search(r"at most (\d+) concurrent sequences", message).group(1))
    assert 100 < fit < 1024
    plan = _serve(llama8b, devices=1, global_batch=fit)  # what the message promises fits
    assert plan.predicted.memory["total"] <= plan.memory_limit_bytes
    assert plan.predicted.max_concurrency >= fit
    with pytest.raises(InfeasibleError, match="the weights alone do not fit"):
        _serve(llama8b, devices=1, global_batch=1, memory_limit_gb=10)


def test_llama3_70b_on_8_h100_serves_32_sequences_of_4k() -> None:
    """The issue's scale check: 32 concurrent 4096-token sequences of Llama-3-70B on one
    8 x H100 node. The plan states its cache and its per-token latency, and the report shows
    them with the prefill and the most sequences that fit."""
    graph = autopar.capture("llama3-70b", seq=4096)
    plan = _serve(graph, devices=8, global_batch=32)
    p = plan.predicted
    cfg = graph.model_config
    per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * (
        cfg["hidden_size"] // cfg["num_attention_heads"]) * 2  # k and v, bf16
    whole = per_token * 32 * 4096  # 43 GB over the node
    devices_holding_a_layer = plan.mesh["tp"] * plan.mesh["pp"]  # kv heads (8) split over tp
    assert p.kv_cache_bytes == pytest.approx(whole / devices_holding_a_layer, rel=0.05)
    assert p.memory["kv_cache"] == p.kv_cache_bytes
    # bandwidth-bound: at least the weights and caches one device reads, per token
    device = load_cluster("h100-80g").device
    floor = (p.memory["params"] + p.kv_cache_bytes) / device.memory_bandwidth
    assert floor < p.decode_s_per_token < 4 * floor
    assert p.prefill_s > p.decode_s_per_token and p.max_concurrency >= 32
    text = plan.report()
    for words in ("decode", "per token", "prefill", "KV cache", "at most"):
        assert words in text
    with pytest.raises(InfeasibleError, match=r"at most \d+ concurrent sequences of 4096"):
        _serve(graph, devices=8, global_batch=1024)
