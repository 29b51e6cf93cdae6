"""Per-op tensor-parallel sharding by CP-SAT."""

from __future__ import annotations

import pytest

import autopar
from autopar.cost import ParallelConfig, estimate, load_cluster
from autopar.cost.tp_layout import tp_layout
from autopar.search.sharding import solve_block, solve_layouts


def _leaf(graph, block, positions):
    return sorted(graph.op(block.nodes[i]).module_path.split(".")[-1] for i in positions)


@pytest.fixture(scope="module")
def llama():
    return autopar.capture("llama3-8b", seq=2048)


def test_llama_layer_gets_megatron_layout_proved_optimal(llama) -> None:
    cluster = load_cluster("a100-80g")
    layer = llama.layer_blocks[0]
    sol = solve_block(llama, layer, 8, cluster)
    assert sol.status == "OPTIMAL" and sol.objective_s == pytest.approx(sol.bound_s)
    assert _leaf(llama, layer, sol.column) == ["gate_proj", "k_proj", "q_proj", "up_proj",
                                               "v_proj"]
    assert _leaf(llama, layer, sol.row) == ["down_proj", "o_proj"]
    tail = solve_block(llama, llama.blocks[-1], 8, cluster)
    assert _leaf(llama, llama.blocks[-1], tail.column) == ["lm_head"]  # vocabulary-parallel


def test_heads_that_do_not_divide_keep_attention_replicated() -> None:
    graph = autopar.capture("gpt2", seq=1024)  # 12 heads
    layer = graph.layer_blocks[0]
    sol = solve_block(graph, layer, 8, load_cluster("a100-80g"))
    assert _leaf(graph, layer, sol.column) == ["c_fc"]  # the MLP still splits
    assert _leaf(graph, layer, sol.row) == ["c_proj"]
    assert all("attn" not in graph.op(layer.nodes[i]).module_path for i in sol.sharded)


def test_slow_links_make_replication_cheaper() -> None:
    graph = autopar.capture("tiny-llama", seq=32)
    sol = solve_block(graph, graph.layer_blocks[0], 2, load_cluster("cpu"))
    assert sol.column == [] and sol.row == []  # all-reduces cost more than they save


def test_chosen_layout_drives_the_cost_model() -> None:
    graph = autopar.capture("tiny-llama", seq=32)
    cluster = load_cluster("cpu")
    before = estimate(graph, cluster, ParallelConfig(tp=2))
    assert tp_layout(graph, graph.layer_blocks[0]).row  # Megatron by default
    layouts, _ = solve_layouts(graph, [2], cluster)
    assert not tp_layout(graph, graph.layer_blocks[0], layouts[2]).row
    after = estimate(graph, cluster, ParallelConfig(tp=2, tp_layouts=layouts[2]))
    assert after.stages[0].comm_s < before.stages[0].comm_s
    assert after.step_time_s < before.step_time_s


def test_estimate_does_not_depend_on_what_was_planned_before() -> None:
    """Layouts travel in the config: planning another graph or cluster changes nothing."""
    graph = autopar.capture("tiny-llama", seq=32)
    config = ParallelConfig(tp=2, dp=2)
    first = estimate(graph, "a100-80g", config).step_time_s
    autopar.plan(graph, devices=4, cluster="cpu", global_batch=4)
    autopar.plan(autopar.capture("tiny-gpt2", seq=32), devices=2, cluster="a100-80g",
                 global_batch=2)
    assert estimate(graph, "a100-80g", config).step_time_s == first
    with pytest.raises(ValueError, match="tp_layouts are for tp=2"):
        ParallelConfig(tp=4, tp_layouts=solve_layouts(graph, [2], load_cluster("cpu"))[0][2])


def test_fewer_kv_heads_than_tp_replicates_them() -> None:
    """Gemma-2B has one kv head: at tp=8 the attention splits by query heads and every rank
    computes the kv head (k_proj, v_proj whole on every rank)."""
    graph = autopar.capture("gemma-2b", seq=2048)
    layer = graph.layer_blocks[0]
    sol = solve_block(graph, layer, 8, load_cluster("a100-80g"))
    assert sol.status == "OPTIMAL"
    assert _leaf(graph, layer, [i for i, _ in sol.kv]) == ["k_proj", "v_proj"]
    assert all(heads == 1 for _, heads in sol.kv)
    assert "q_proj" in _leaf(graph, layer, sol.column)
    assert "o_proj" in _leaf(graph, layer, sol.row)
