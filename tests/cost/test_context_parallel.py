"""Context parallelism priced: per-device memory and compute split over cp, ring attention's
key/value passes hidden under long attention and exposed under short, all-to-all refused where
the heads do not divide, and plans with cp > 1 priced but not compiled."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

import autopar
from autopar.cost.block_cost import (
    block_cost,
    captured_batch,
    captured_float_bytes,
    resolve_precision,
)
from autopar.cost.compute import op_time
from autopar.cost.config import ParallelConfig
from autopar.cost.context_parallel import context_parallel_comm, kv_replication, ulysses_refusal
from autopar.cost.estimate import estimate
from autopar.cost.hardware import load_cluster
from autopar.cost.tp_layout import cache_split, tp_layout
from autopar.ir.graph import OpKind


@pytest.fixture(scope="module")
def llama_8k() -> autopar.ir.Graph:
    return autopar.capture("llama3-8b", seq=8192)


def test_cp_halves_activation_memory_and_compute_per_device(llama_8k) -> None:
    base = dict(tp=8, pp=1, dp=1, microbatch_size=1, num_microbatches=1)
    one = estimate(llama_8k, "h100-80g", ParallelConfig(**base))
    two = estimate(llama_8k, "h100-80g", ParallelConfig(**base, cp=2))
    assert two.memory.activations == pytest.approx(one.memory.activations / 2, rel=0.02)
    # same parameters on every cp rank
    assert two.memory.params == pytest.approx(one.memory.params)
    assert two.stages[0].compute_s < 0.6 * one.stages[0].compute_s
    # the cp ranks reduce gradients with the data-parallel ones: ZeRO shards over dp x cp
    sharded = estimate(llama_8k, "h100-80g", ParallelConfig(**{**base, "dp": 2}, cp=2,
                                                               zero_stage=1))
    alone = estimate(llama_8k, "h100-80g", ParallelConfig(**{**base, "dp": 2}, zero_stage=1))
    assert sharded.memory.optimizer == pytest.approx(alone.memory.optimizer / 2, rel=1e-6)


def _ring(graph, cp: int, tp: int):
    """The ring's communication of the first layer (before and after overlap), the layer's
    cost, and the cluster: at cp ranks of tp-wide groups on H100 nodes."""
    cluster = load_cluster("h100-80g")
    config = resolve_precision(ParallelConfig(tp=tp, cp=cp), cluster)
    precision = config.precision
    block = graph.layer_blocks[0]
    cost = block_cost(graph, block, config, cluster, "none")
    seq_scale = precision.activation_bytes / captured_float_bytes(graph) / captured_batch(graph)
    # this rank's attention compute: 1 / cp of the sequence's
    fwd = sum(op_time(graph.op(n), cluster.device, precision.compute,
                      1 / (cp * captured_batch(graph)), seq_scale / cp)
              for n in block.nodes if graph.op(n).kind is OpKind.ATTENTION)
    kv_split = cache_split(graph, block, tp_layout(graph, block, None), tp)
    comm = context_parallel_comm(graph, block, config, cluster, seq_scale, kv_split, fwd,
                                 2 * fwd, "none")
    return comm, cost, cluster


def test_ring_kv_passes_hide_under_long_attention_and_show_under_short() -> None:
    short, _, cluster = _ring(autopar.capture("llama3-8b", seq=512), cp=2, tp=8)
    long, cost, _ = _ring(autopar.capture("llama3-8b", seq=32768), cp=2, tp=8)
    slowdown = cluster.device.overlap.compute_slowdown
    assert short.fwd_comm_s > 0 and long.fwd_comm_s > 0
    # long attention: the passes run beside it, costing only the slowdown of what they share
    assert long.fwd_exposed_s <= (slowdown + 1e-9) * long.fwd_comm_s
    assert long.bwd_exposed_s <= (slowdown + 1e-9) * long.bwd_comm_s
    # short attention: most of the passes wait in the open
    assert short.fwd_exposed_s > max(0.5, slowdown + 0.1) * short.fwd_comm_s
    # the backward passes K/V and dK/dV: twice the bytes
    assert long.bwd_comm_s > 1.5 * long.fwd_comm_s
    assert cost.cp_fwd_comm_s == pytest.approx(long.fwd_exposed_s, rel=0.05)


def test_alltoall_refused_where_heads_do_not_divide_and_priced_where_they_do(llama_8k) -> None:
    # 8 key/value heads over tp=8 leave one per rank: no all-to-all over 2 cp ranks splits it
    # (autopar's runtime repeats it per query head: test_alltoall_with_too_few_kv_heads...)
    with pytest.raises(autopar.PlanError, match="divisible by 2"):
        autopar.plan(llama_8k, devices=16, cluster="h100-80g", global_batch=8,
                     constraints=dict(tp=8, cp=2, cp_mode="alltoall", engine="megatron"))
    plan = autopar.plan(llama_8k, devices=16, cluster="h100-80g", global_batch=8,
                        constraints=dict(tp=4, cp=2, cp_mode="alltoall", pp=1))
    assert plan.mesh["cp"] == 2 and plan.cp_mode == "alltoall"
    # all-to-alls sit on attention's critical path: more exposed communication than the
    # ring's, whose passes hide under 8k-token attention; the ring pays in its kernels
    # instead (two over half the keys each, and the merge of their outputs), so at 8k tokens
    # over two ranks the two modes come within 1% of each other
    ring = autopar.plan(llama_8k, devices=16, cluster="h100-80g", global_batch=8,
                        constraints=dict(tp=4, cp=2, cp_mode="ring", pp=1,
                                         microbatch_size=plan.microbatch_size,
                                         zero_stage=plan.zero_stage,
                                         recompute=plan.recompute[0]))
    a2a_b, ring_b = plan.predicted.breakdown, ring.predicted.breakdown
    assert ring_b["comm_s"] < a2a_b["comm_s"]
    assert ring_b["compute_s"] > a2a_b["compute_s"]
    assert ring.predicted.step_time_s == pytest.approx(plan.predicted.step_time_s, rel=0.01)


def test_a_pinned_cp_is_priced_saved_and_refused_by_compile_in_a_mode_it_does_not_run(
        llama_8k, tmp_path) -> None:
    plan = autopar.plan(llama_8k, devices=16, cluster="h100-80g", global_batch=8,
                        constraints={"cp": 2, "tp": 8})
    assert plan.mesh == {"pp": plan.mesh["pp"], "dp": plan.mesh["dp"], "cp": 2, "ep": 1,
                         "tp": 8}
    assert plan.predicted.step_time_s > 0
    path = plan.save(tmp_path / "plan.yaml")
    loaded = autopar.Plan.load(path)
    assert loaded.mesh["cp"] == 2 and loaded.cp_mode == "ring"
    assert "cp=2" in plan.report() and "ring attention" in plan.report()
    out = tmp_path / "artifact"
    # a plan file naming a mode the runtime does not run is refused before anything is written
    unknown = dataclasses.replace(plan, cp_mode="zigzag")
    with pytest.raises(autopar.PlanError, match="cp_mode"):
        autopar.compile("llama3-8b", None, unknown, out)
    assert not out.exists()
    # the free search weighs cp with the other axes: never slower than this pinned plan
    # (beyond the robust choice's 3%)
    free = autopar.plan(llama_8k, devices=16, cluster="h100-80g", global_batch=8)
    assert free.predicted.step_time_s <= plan.predicted.step_time_s * 1.03


def test_hybrid_is_all_to_all_inside_a_node_and_allgather_is_exposed(llama_8k) -> None:
    cluster = load_cluster("h100-80g")
    block = llama_8k.layer_blocks[0]

    def layer(**kw):
        config = resolve_precision(ParallelConfig(**kw), cluster)
        return block_cost(llama_8k, block, config, cluster, "none")

    # 4 cp ranks 2 apart fit in one 8-device node: hybrid is all-to-all there
    inside = layer(tp=2, cp=4, cp_mode="hybrid")
    assert inside.cp_fwd_comm_s == pytest.approx(layer(tp=2, cp=4, cp_mode="alltoall")
                                                 .cp_fwd_comm_s)
    # 4 cp ranks 4 apart span two nodes: all-to-all in pairs, a ring of 2 across
    # (an all-to-all over all 4 splits 2 kv heads per tp rank 4 ways only by repeating them)
    across = layer(tp=4, cp=4, cp_mode="hybrid")
    assert across.cp_fwd_comm_s > 0
    assert across.cp_fwd_comm_s != pytest.approx(layer(tp=4, cp=4, cp_mode="ring")
                                                 .cp_fwd_comm_s)
    with pytest.raises(ValueError, match="divisible by 4"):  # where kv heads are not repeated
        layer(tp=4, cp=4, cp_mode="alltoall", engine="megatron")
    # Llama 3's all-gather waits for K/V; the ring hides its passes under 8k attention
    gathered, ring = layer(tp=8, cp=2, cp_mode="allgather"), layer(tp=8, cp=2)
    assert gathered.cp_fwd_comm_s > ring.cp_fwd_comm_s > 0
    assert gathered.cp_bwd_comm_s > gathered.cp_fwd_comm_s  # gathered again, reduce-scattered


def test_a_ring_runs_attention_one_key_block_at_a_time() -> None:
    """Under a ring each step's kernel sees 1 / ring of the keys (and the steps' outputs are
    merged), so a rank's compute is more than the all-to-all's, which runs one kernel over the
    whole sequence on 1 / cp of the heads; the difference shrinks as the blocks grow (though
    attention's share of the layer grows with them)."""
    cluster = load_cluster("h100-80g")

    def extra(seq: int) -> float:
        graph = autopar.capture("llama3-8b", seq=seq)
        block = graph.layer_blocks[0]
        cost = {}
        for mode in ("ring", "alltoall"):
            config = resolve_precision(ParallelConfig(tp=4, cp=2, cp_mode=mode), cluster)
            layer = block_cost(graph, block, config, cluster, "none")
            cost[mode] = layer.fwd_s + layer.bwd_s
        return cost["ring"] / cost["alltoall"] - 1

    short, long = extra(2048), extra(32768)
    assert short > 0 and long > 0
    assert long < short


def test_alltoall_with_too_few_kv_heads_is_priced_with_them_repeated(tmp_path) -> None:
    """Tiny Llama's 2 key/value heads over 4 all-to-all ranks run only where the engine
    repeats them per query head first (autopar's runtime), and then move as many bytes as a
    model with 4 key/value heads: the same exchange as the MHA twin's."""
    assert ulysses_refusal(32, 8, 8, 2) is not None  # Llama-3-8B at tp=8: 1 kv head per rank
    assert ulysses_refusal(32, 8, 8, 2, replicate_kv=True) is None
    assert kv_replication(32, 8, 8, 2, True) == 4.0
    assert kv_replication(32, 8, 4, 2, True) == 1.0  # 2 per rank split over 2: no repeat
    config = json.loads((Path(autopar.__file__).parent / "models/configs/tiny-llama.json")
                        .read_text())
    (tmp_path / "mha.json").write_text(json.dumps({**config, "num_key_value_heads": 4}))
    gqa = autopar.capture("tiny-llama", seq=256)
    mha = autopar.capture(str(tmp_path / "mha.json"), seq=256)
    cluster = load_cluster("h100-80g")

    def comm(graph, engine: str = "autopar") -> float:
        config = resolve_precision(ParallelConfig(cp=4, cp_mode="alltoall", engine=engine),
                                   cluster)
        return block_cost(graph, graph.layer_blocks[0], config, cluster, "none").cp_fwd_comm_s

    assert comm(gqa) == pytest.approx(comm(mha), rel=1e-9)
    with pytest.raises(ValueError, match="divisible by 4"):
        comm(gqa, engine="megatron")
