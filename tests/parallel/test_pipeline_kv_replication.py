"""kv heads replicated over tensor-parallel ranks inside pipeline stages equal one process.

When tp does not divide an attention's kv heads, the planner keeps the key and value
projections whole on every tp rank (placement "(kv-heads)"). Inside a traced pipeline stage
each rank computes every kv head and DTensor hands its query heads theirs
(tp_styles.WholeKvProjection). Plans come from ``autopar.plan`` pinned pp2 x tp2 (4 gloo
processes) on Hugging Face decoders with one kv head: Gemma's tiny twin under the schedule the
search picks, and a tiny Llama under 1F1B, interleaved 1F1B and with sequence parallelism.
Losses and every first-step gradient must equal one process (fp32, 1e-4). Cached generation
under such a plan (eager layers, one kv head per rank as at pp=1) gives one process's tokens.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import autopar
from autopar.codegen import program_text
from autopar.models.hf import build_model, load_config
from autopar.models.source import describe_source
from tests.fixtures.harness import run_in_group, run_ranks, spawn_ranks

pytestmark = pytest.mark.dist
STEPS, SEQ, BATCH = 3, 32, 4
ONE_KV_LLAMA = {**load_config("tiny-llama"), "num_key_value_heads": 1}  # 4 query heads


def _kv_layout(trainer) -> tuple[int, int]:
    """(whole kv projections, split query projections) in this rank's stage: a replicated kv
    projection keeps its weight a plain tensor of the whole model's shape; a query projection
    is a DTensor sharded over tp."""
    from torch.distributed.tensor import DTensor

    _, kv_heads, head_dim = next(iter(trainer.plan.placements["heads"].values()))
    whole = split = 0
    for name, p in trainer.model.named_parameters():
        if name.endswith(("k_proj.weight", "v_proj.weight")):
            assert not isinstance(p, DTensor), name
            assert p.shape[0] == kv_heads * head_dim, (name, p.shape)
            whole += 1
        elif name.endswith("q_proj.weight"):
            assert isinstance(p, DTensor) and p.placements[0].is_shard(), name
            split += 1
    return whole, split


def _source_and_graph(name: str, tmp_path) -> tuple[dict, object]:
    if name != "tiny-llama-1kv":
        return describe_source(name), autopar.capture(name, seq=SEQ)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(ONE_KV_LLAMA))
    return describe_source(str(path)), autopar.capture(str(path), seq=SEQ)


def _pipeline_plan(graph, **pins):
    plan = autopar.plan(graph, devices=4, global_batch=BATCH, constraints=dict(
        pp=2, tp=2, dp=1, microbatch_size=1, precision="fp32", **pins))
    assert (plan.mesh["pp"], plan.mesh["tp"]) == (2, 2)
    params = plan.placements["params"]
    replicated = {k for k, v in params.items() if "(kv-heads)" in v}
    # the planner really replicates kv heads: both projections of every layer
    assert replicated == {k for k in params if k.endswith(("k_proj.weight", "v_proj.weight"))}
    assert len(replicated) == 2 * len(graph.layer_blocks)
    return plan


def _assert_equal_to_one_process(source: dict, graph, plan) -> None:
    # the generated program (what every rank runs) lays the stages' kv projections out whole
    assert "WholeKvProjection()" in program_text(plan, source)
    single = autopar.plan(graph, devices=1, global_batch=BATCH,
                          constraints=dict(microbatch_size=1, precision="fp32"))
    reference, _, ref_grads = run_ranks(source, single, STEPS, first_grads=True)
    losses, sharded, grads, (whole, split) = run_ranks(source, plan, STEPS, first_grads=True,
                                                       probe=_kv_layout)
    assert sharded > 0 and split > 0  # rank 0's stage holds split query projections ...
    assert whole == 2 * split  # ... and whole key and value projections beside each
    assert losses == pytest.approx(reference, rel=1e-4, abs=1e-4)
    assert set(ref_grads) <= set(grads)  # (a tied LM head has its own copy in a pipeline)
    wrong = [n for n, g in ref_grads.items()
             if np.linalg.norm(grads[n] - g) > 1e-4 * max(np.linalg.norm(g), 1e-8)]
    assert not wrong, f"first-step gradients differ: {wrong[:5]}"


def test_pp2_tp2_kv_replicated_gemma_equals_one_process(tmp_path) -> None:
    """Gemma's tiny twin (4 query heads, 1 kv head, tied head) under the search's schedule."""
    source, graph = _source_and_graph("tiny-gemma", tmp_path)
    _assert_equal_to_one_process(source, graph, _pipeline_plan(graph))


@pytest.mark.parametrize("pins", [dict(schedule="1f1b"), dict(schedule="interleaved"),
                                  dict(sequence_parallel=True)],
                         ids=["1f1b", "interleaved", "sequence-parallel"])
def test_pp2_tp2_kv_replicated_llama_equals_one_process(pins: dict, tmp_path) -> None:
    source, graph = _source_and_graph("tiny-llama-1kv", tmp_path)
    plan = _pipeline_plan(graph, **pins)
    for key, value in pins.items():
        assert getattr(plan, key) == value
    _assert_equal_to_one_process(source, graph, plan)


PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12], [20, 21, 22], [30, 31, 32, 33, 34]]
NEW = 20


def _generator_model():
    torch.manual_seed(0)
    return build_model(ONE_KV_LLAMA, device="cpu", dtype=torch.float32).eval()


def _generate_under(plan_dict: dict) -> list:
    from autopar.plan import Plan

    generator = autopar.Generator(_generator_model(), Plan.from_dict(plan_dict))
    return generator.generate(PROMPTS, max_new_tokens=NEW).tolist()


def _generation_rank(rank: int, port: int, out, world: int, plan_dict: dict) -> None:
    run_in_group(rank, port, out, world, _generate_under, plan_dict)


def test_pp2_tp2_kv_replicated_generation_gives_one_process_tokens(tmp_path) -> None:
    """Serving with pipeline stages is no longer refused: each rank caches the one kv head
    its query heads read, in the layers its stage owns."""
    _, graph = _source_and_graph("tiny-llama-1kv", tmp_path)
    plan = _pipeline_plan(graph, schedule="1f1b", sequence_parallel=False)
    expected = autopar.Generator(_generator_model()).generate(PROMPTS, max_new_tokens=NEW)
    (tokens,) = spawn_ranks(_generation_rank, 4, (4, plan.to_dict()), timeout_s=180)
    assert tokens == expected.tolist()
