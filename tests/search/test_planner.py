"""autopar.plan on real-size models: legal, sensible, explainable, deterministic."""

from __future__ import annotations

import pytest

import autopar
from autopar.search.space import model_facts


@pytest.fixture(scope="module")
def llama8b():
    return autopar.capture("llama3-8b", seq=4096)


@pytest.fixture(scope="module")
def mixtral():
    return autopar.capture("mixtral-8x7b", seq=4096)


def _assert_legal(plan, graph) -> None:
    facts = model_facts(graph)
    m = plan.mesh
    assert m["pp"] * m["dp"] * m["cp"] * m["tp"] * m["ep"] == plan.devices
    # context parallelism cuts every sequence in 2 cp balanced chunks (cp ranks of ``cp``
    # tokens each under all-to-all)
    chunks = m["cp"] if plan.cp_mode == "alltoall" else 2 * m["cp"]
    assert m["cp"] == 1 or facts.seq % chunks == 0
    split_heads = {n for nodes in plan.placements["nodes_by_block_type"].values()
                   for n, s in nodes.items() if s == "split"}
    for op in graph.ops:  # attention splits over tp only by whole heads
        if op.kind.value == "attention" and op.name in split_heads:
            assert op.input_meta[0].shape[1] % m["tp"] == 0
    assert m["pp"] <= len(graph.blocks)
    assert facts.experts % m["ep"] == 0 if facts.experts else m["ep"] == 1
    assert plan.global_batch == m["dp"] * m["ep"] * plan.microbatch_size * plan.num_microbatches
    for stage in plan.predicted.stages:  # every device, not the average
        assert stage["memory"]["total"] <= plan.memory_limit_bytes
    plan.validate()


def test_llama_8b_on_64_is_legal_and_explained(llama8b) -> None:
    plan = autopar.plan(llama8b, devices=64, global_batch=512)
    _assert_legal(plan, llama8b)
    assert plan.solver["gap"] == 0.0 and not plan.solver["timed_out"]
    fastest = plan.solver["robust"]["fastest_step_time_s"]
    assert plan.predicted.step_time_s <= fastest * 1.03 * (1 + 1e-6)
    assert plan.alternatives and all(a["step_time_s"] >= fastest * (1 - 1e-6)
                                     for a in plan.alternatives)
    assert 0 < plan.predicted.mfu < 1
    assert set(plan.predicted.memory) >= {"params", "grads", "optimizer", "activations",
                                          "kv_cache", "buffers", "total"}


def test_small_model_large_batch_gets_pure_data_parallelism() -> None:
    plan = autopar.plan("gpt2", devices=8, global_batch=256)
    assert plan.mesh == {"pp": 1, "dp": 8, "cp": 1, "tp": 1, "ep": 1}


def test_gpt3_175b_on_1024_a100_keeps_tp_in_a_node_and_matches_megatron_3d() -> None:
    """Tensor parallelism stays on NVLink, and the free plan is at least as fast as the
    Megatron-style 3D layout pinned (whose collectives the free search also saw)."""
    graph = autopar.capture("gpt3-175b", seq=2048)  # vocabulary 50,257: the head stays whole
    plan = autopar.plan(graph, devices=1024, global_batch=1536)
    _assert_legal(plan, graph)
    assert plan.mesh["tp"] <= 8
    three_d = autopar.plan(graph, devices=1024, global_batch=1536,
                           constraints={"tp": 8, "pp": 8, "schedule": "interleaved"})
    assert plan.solver["robust"]["fastest_step_time_s"] <= three_d.predicted.step_time_s


def test_too_small_for_zero0_moves_to_sharding_recompute_or_offload(llama8b) -> None:
    # 8B x 16 bytes of mixed-precision Adam states is 128 GB: plain data parallelism cannot fit
    plan = autopar.plan(llama8b, devices=8, global_batch=8,
                        constraints={"pp": 1, "tp": 1})
    assert plan.zero_stage > 0 or plan.offload or set(plan.recompute) != {"none"}
    _assert_legal(plan, llama8b)
    pinned = autopar.plan(llama8b, devices=8, global_batch=8,
                          constraints={"pp": 1, "tp": 1, "zero_stage": 3, "offload": "none"},
                          memory_limit_gb=40)
    assert set(pinned.recompute) != {"none"}  # activations of 4096 tokens must be recomputed


def test_infeasible_budget_names_the_bound_and_the_way_out() -> None:
    graph = autopar.capture("llama3-70b", seq=4096)
    with pytest.raises(autopar.InfeasibleError) as info:
        autopar.plan(graph, devices=2, cluster="v100-16g", global_batch=2)
    message = str(info.value)
    assert "per device" in message and "needs" in message and "use " in message
    assert "\n" not in message and "OPTIMAL" not in message and "status" not in message


def test_a_model_no_host_can_offload_to_is_refused_naming_the_host() -> None:
    """Llama-3-405B on 8 A100-80G: offloading its states would keep 5 TB on a node with
    2.2 TB of host memory. The refusal says so (it once named an offloading candidate's 9 GB on
    the device as the need) and does not offer offload as the way out."""
    graph = autopar.capture("llama3-405b")
    with pytest.raises(autopar.InfeasibleError) as info:
        autopar.plan(graph, devices=8)
    message = str(info.value)
    assert "per node there, above the node's" in message and "of host memory" in message
    way_out = message.rsplit("; ", 1)[1]
    assert way_out.startswith("use more devices") and "offload" not in way_out


def test_mixtral_expert_parallel_is_legal(mixtral) -> None:
    plan = autopar.plan(mixtral, devices=64, global_batch=512)
    _assert_legal(plan, mixtral)
    assert 8 % plan.mesh["ep"] == 0


def test_constraints_and_presets(llama8b) -> None:
    plan = autopar.plan(llama8b, devices=64, global_batch=512, constraints={"tp": 8, "pp": 2})
    assert plan.mesh["tp"] == 8 and plan.mesh["pp"] == 2
    zero3 = autopar.plan(llama8b, devices=64, global_batch=512, constraints="zero3-only")
    assert zero3.zero_stage == 3 and zero3.mesh["tp"] == zero3.mesh["pp"] == 1
    mf = autopar.plan(llama8b, devices=8, global_batch=8, constraints="mindformers-style")
    # optimizer_shard is ZeRO-1, which the runtime runs as ZeRO-2 under tensor parallelism
    assert (mf.mesh["dp"], mf.mesh["tp"], mf.zero_stage) == (2, 4, 2)
    assert set(mf.recompute) == {"full"}
    text = autopar.plan(llama8b, devices=64, global_batch=512, constraints="tp=4,zero_stage=2")
    assert text.mesh["tp"] == 4 and text.zero_stage == 2
    with pytest.raises(autopar.PlanError, match="unknown constraint"):
        autopar.plan(llama8b, devices=8, constraints={"tensor_parallel": 2})
    with pytest.raises(autopar.PlanError, match="preset"):
        autopar.plan(llama8b, devices=8, constraints="no-such-preset")


def test_pinning_everything_evaluates_that_one_plan(llama8b) -> None:
    pins = {"pp": 2, "dp": 4, "tp": 8, "ep": 1, "microbatch_size": 1, "num_microbatches": 8,
            "zero_stage": 2, "recompute": "selective", "offload": "none", "schedule": "1f1b",
            "sequence_parallel": False}
    plan = autopar.plan(llama8b, devices=64, global_batch=32, constraints=pins)
    assert plan.solver["evaluated"] == 1
    assert plan.schedule == "1f1b" and set(plan.recompute) == {"selective"}


def test_inference_plan(llama8b) -> None:
    plan = autopar.plan(llama8b, devices=8, task="infer", global_batch=16)
    assert plan.zero_stage == 0 and set(plan.recompute) == {"none"}
    assert plan.predicted.memory["kv_cache"] > 0 and plan.predicted.memory["optimizer"] == 0


def test_time_limit_is_honoured(mixtral) -> None:
    plan = autopar.plan(mixtral, devices=64, global_batch=512, time_limit_s=0.0)
    assert plan.solver["timed_out"] and plan.solver["gap"] >= 0.0
    assert plan.solver["bound_s"] <= plan.predicted.step_time_s


def test_progress_reports(llama8b) -> None:
    seen = []
    autopar.plan(llama8b, devices=64, global_batch=512, progress=lambda f, msg: seen.append(f))
    assert seen and seen[-1] == 1.0 and all(0.0 <= f <= 1.0 for f in seen)


def test_search_proposes_only_what_the_runtime_runs() -> None:
    """Expert parallelism with ZeRO-1 and inside pipeline stages
    (tests/parallel/test_expert_parallel.py) and sequence parallelism inside pipeline stages
    (tests/parallel/test_pipeline_sequence_parallel.py) run, so none is refused; the search
    proposes an ep plan with ZeRO-1 when pinned."""
    from autopar.cost.config import ParallelConfig
    from autopar.plan.support import unsupported

    graph = autopar.capture("tiny-mixtral", seq=32)
    plan = autopar.plan(graph, devices=8, global_batch=16, constraints=dict(ep=2, zero_stage=1))
    assert (plan.mesh["ep"], plan.zero_stage) == (2, 1)

    assert unsupported(ParallelConfig(ep=2, pp=2, num_microbatches=2)) is None
    assert unsupported(ParallelConfig(ep=2, dp=2, zero_stage=1)) is None
    assert unsupported(ParallelConfig(tp=2, pp=2, sequence_parallel=True, num_microbatches=2)) \
        is None
    assert unsupported(ParallelConfig(ep=2, dp=2, zero_stage=3, tp=2)) is None
    # DTensor parameters are data-parallel through fully_shard (ZeRO-2/3), and FSDP2 offloads
    # sharded states: ZeRO-0/1 under tp, or with offload over several replicas, never run
    assert "tensor parallelism" in unsupported(ParallelConfig(tp=2, dp=2, zero_stage=1))
    assert unsupported(ParallelConfig(tp=2, dp=1, zero_stage=0)) is None
    assert "offload" in unsupported(ParallelConfig(dp=2, zero_stage=0,
                                                   offload=frozenset({"optimizer"})))
    assert unsupported(ParallelConfig(dp=1, offload=frozenset({"optimizer"}))) is None
    piped = autopar.plan(graph, devices=4, global_batch=8, constraints=dict(ep=2, pp=2))
    assert (piped.mesh["pp"], piped.mesh["ep"]) == (2, 2)


def test_expert_weights_are_placed_on_the_expert_axis() -> None:
    graph = autopar.capture("tiny-mixtral", seq=32)
    plan = autopar.plan(graph, devices=4, global_batch=8,
                        constraints=dict(ep=2, dp=2, tp=1, pp=1, zero_stage=3))
    params = plan.placements["params"]
    experts = [p for p in params if ".experts." in p]
    assert experts and all(params[p] == "Shard(0)@ep+Shard(0)@dp" for p in experts)
    assert params["model.layers.0.self_attn.q_proj.weight"] == "Shard(0)@dp"


def test_tensor_parallel_groups_never_straddle_nodes() -> None:
    """GPT-2's projections split 3, 6 or 12 ways, but on 8-GPU nodes a group of 3 or 6 would
    span two nodes (and one of 12 would not be whole nodes)."""
    from autopar.search.space import legal_meshes, model_facts

    graph = autopar.capture("gpt2", seq=1024)
    facts = model_facts(graph)
    assert facts.tp_ok(3) and facts.tp_ok(6)
    meshes = legal_meshes(facts, 48, 48, 8, {}, allow_cross_node_tp=True)
    tps = {m.tp for m in meshes}
    assert not tps & {3, 6, 12} and {1, 2, 4, 8} <= tps  # 12 would be 1.5 nodes
    assert {m.tp for m in legal_meshes(facts, 48, 48, 6, {}, allow_cross_node_tp=True)} \
        >= {3, 6}
