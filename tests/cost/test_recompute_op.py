"""Recompute mode ``op`` (torchtitan's op-level selective checkpointing) as the cost model
prices it: which outputs a block keeps, what its backward re-runs, and where the mode is a
value (plans, constraints, exports)."""

from __future__ import annotations

import pytest

import autopar
from autopar.cost.activations import block_activation_bytes
from autopar.cost.block_cost import block_cost, resolve_precision
from autopar.cost.compute import op_time
from autopar.cost.config import ParallelConfig
from autopar.cost.hardware import load_cluster
from autopar.cost.recompute_policy import RECOMPUTE_MODES, op_policy_saved
from autopar.models import GPT, GPTConfig, token_inputs
from autopar.plan.deepspeed import deepspeed_config
from autopar.plan.megatron import megatron_args
from autopar.plan.mindformers import mindformers_yaml


@pytest.fixture(scope="module")
def llama():
    return autopar.capture("tiny-llama", seq=32)


def _kept_projections(graph, block) -> list[str]:
    kept = op_policy_saved(graph, block)
    return sorted(p.split(".")[-2] for n in kept for p in graph.op(n).params)


def test_llama_block_keeps_every_other_projection_and_attention(llama) -> None:
    block = llama.blocks[1]
    kept = op_policy_saved(llama, block)
    # forward order q, k, v, o, gate, up, down: the 1st, 3rd, 5th and 7th are kept
    assert _kept_projections(llama, block) == ["down_proj", "gate_proj", "q_proj", "v_proj"]
    assert any(llama.op(n).kind.name == "ATTENTION" for n in kept)
    assert len(kept) == 5  # nothing else: norms, rotary, silu, products are re-run


def test_biased_linears_are_all_kept() -> None:
    """A linear with a bias reaches the policy as addmm, which is always kept (only mm
    alternates)."""
    cfg = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=2)
    graph = autopar.capture(GPT(cfg), token_inputs(1, cfg.seq_len))
    block = graph.blocks[1]
    linears = [n for n in block.nodes if graph.op(n).kind.name == "LINEAR"]
    assert linears and set(linears) <= op_policy_saved(graph, block)


def test_op_memory_and_recompute_between_selective_and_full(llama) -> None:
    cluster = load_cluster("a100-80g")
    config = resolve_precision(ParallelConfig(microbatch_size=2), cluster)
    block = llama.blocks[1]
    costs = {m: block_cost(llama, block, config, cluster, m) for m in RECOMPUTE_MODES}
    acts = {m: c.activation_bytes for m, c in costs.items()}
    assert acts["full"] < acts["op"] < acts["selective"] <= acts["none"]
    assert costs["none"].recompute_s == 0.0
    assert costs["selective"].recompute_s < costs["op"].recompute_s < costs["full"].recompute_s
    # priced op by op: the forward seconds of exactly the ops the policy does not keep
    kept = op_policy_saved(llama, block)
    precision = config.precision
    scale = 2 * precision.activation_bytes / 4
    expect = sum(op_time(llama.op(n), cluster.device, precision.compute, 2.0, scale, 1.0)
                 for n in block.nodes if n not in kept)
    assert costs["op"].recompute_s == pytest.approx(expect, rel=1e-9)


def test_op_keeps_the_block_input_and_the_kept_outputs(llama) -> None:
    block = llama.blocks[1]
    full = block_activation_bytes(llama, block, recompute="full").stored_bytes
    op = block_activation_bytes(llama, block, recompute="op").stored_bytes
    kept = sum(llama.op(n).output_meta[0].nbytes for n in op_policy_saved(llama, block))
    lse = 1 * 4 * 32 * 4  # fp32 log-sum-exp: batch x heads x seq
    assert op == pytest.approx(full + kept + lse)


def test_op_is_a_plan_value_and_a_constraint(llama) -> None:
    plan = autopar.plan(llama, devices=2, cluster="a100-80g", global_batch=4,
                        constraints={"recompute": "op", "dp": 2})
    assert set(plan.recompute) == {"op"}
    assert plan.recompute_counts() == {"op": len(plan.recompute)}
    again = autopar.Plan.from_dict(plan.to_dict())
    assert again.recompute == plan.recompute
    with pytest.raises(autopar.PlanError, match="none, selective, op, full"):
        autopar.plan(llama, devices=1, cluster="a100-80g", global_batch=4,
                     constraints={"recompute": "layer"})


@pytest.mark.parametrize("export", [megatron_args, mindformers_yaml, deepspeed_config])
def test_exports_refuse_op(llama, export) -> None:
    plan = autopar.plan(llama, devices=2, cluster="a100-80g", global_batch=4,
                        constraints={"recompute": "op", "dp": 2})
    with pytest.raises(autopar.PlanError, match="no op-level recompute"):
        export(plan)


def test_megatron_engine_refuses_pinned_op(llama) -> None:
    with pytest.raises((autopar.PlanError, autopar.InfeasibleError), match="op-level"):
        autopar.plan(llama, devices=2, cluster="a100-80g", global_batch=4,
                     constraints={"recompute": "op", "engine": "megatron", "dp": 2})
