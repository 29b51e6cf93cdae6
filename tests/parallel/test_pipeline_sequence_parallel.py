"""Sequence parallelism inside pipeline stages equals one process.

Inside a stage the residual stream between layers is sharded on the sequence (Megatron-SP);
stages exchange whole activations (the stage's first layer takes its shard, its last layer
gathers). Plans come from ``autopar.plan``: pinned pp2 x tp2 with sequence parallelism on
tiny-llama, and MindFormers' Llama-2-70B 64-card file scaled down to a tiny twin of its shape
ratios on 4 processes. Losses and every first-step gradient must equal one process (1e-4).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

import autopar
from autopar.models.hf import load_config
from autopar.models.source import describe_source
from tests.fixtures.harness import run_ranks

pytestmark = pytest.mark.dist
STEPS, SEQ = 3, 32
MINDFORMERS = Path(__file__).resolve().parent.parent / "fixtures" / "mindformers" / \
    "pretrain_llama2_70b_bf16_64p.yaml"


def _sequence_parallel_norms(trainer) -> int:
    """How many of this rank's layer norms run on sequence shards: their weights become
    replicated DTensors only under sequence parallelism (plain tensor parallelism leaves
    norms alone in a traced stage)."""
    from torch.distributed.tensor import DTensor

    return sum(1 for name, p in trainer.model.named_parameters()
               if "layernorm" in name and isinstance(p, DTensor))


def _single(graph, batch: int):
    return autopar.plan(graph, devices=1, global_batch=batch,
                        constraints=dict(microbatch_size=1, precision="fp32"))


def _assert_equal_to_one_process(source: dict, graph, plan) -> None:
    reference, _, ref_grads = run_ranks(source, _single(graph, plan.global_batch), STEPS,
                                        first_grads=True)
    losses, sharded, grads, norms = run_ranks(source, plan, STEPS, first_grads=True,
                                              probe=_sequence_parallel_norms)
    assert sharded > 0  # rank 0's stage really holds split weights
    assert norms > 0  # ... and runs its layers' norms on sequence shards
    assert losses == pytest.approx(reference, rel=1e-4, abs=1e-4)
    assert sorted(grads) == sorted(ref_grads)
    wrong = [n for n, g in ref_grads.items()
             if np.linalg.norm(grads[n] - g) > 1e-4 * max(np.linalg.norm(g), 1e-8)]
    assert not wrong, f"first-step gradients differ: {wrong[:5]}"


@pytest.mark.parametrize("schedule", ["1f1b", "zero_bubble"])
def test_pp2_tp2_sequence_parallel_tiny_llama_equals_one_process(schedule: str) -> None:
    """zero_bubble: torch's split backward (input gradients, then weight gradients) runs
    through the stage's gathers and scatters too."""
    source, graph = describe_source("tiny-llama"), autopar.capture("tiny-llama", seq=SEQ)
    plan = autopar.plan(graph, devices=4, global_batch=4, constraints=dict(
        pp=2, tp=2, dp=1, sequence_parallel=True, microbatch_size=1, precision="fp32",
        schedule=schedule))
    assert (plan.mesh["pp"], plan.mesh["tp"], plan.sequence_parallel, plan.schedule) == \
        (2, 2, True, schedule)
    _assert_equal_to_one_process(source, graph, plan)


# MindFormers' Llama-2-70B file runs dp2 x mp4 x pp8 on 64 cards with sequence parallelism.
# On at most 4 CPU processes the closest mesh keeping pp, mp and sequence parallelism all
# above 1 is pp2 x mp2 (dp drops to 1). The twin keeps what each rank holds in proportion:
# 10 layers per stage (80 / 8), 16 query and 2 key/value heads per tp rank (64 / 4, 8 / 4:
# GQA groups of 8), the feed-forward 3.5 x hidden (28672 / 8192); head size, vocabulary and
# sequence shrink to CPU sizes.
TWIN_PP, TWIN_TP = 2, 2
TWIN = {"num_hidden_layers": 10 * TWIN_PP, "num_attention_heads": 16 * TWIN_TP,
        "num_key_value_heads": 2 * TWIN_TP, "hidden_size": 4 * 16 * TWIN_TP,
        "intermediate_size": 7 * 4 * 16 * TWIN_TP // 2, "vocab_size": 256,
        "max_position_embeddings": SEQ, "dtype": "float32"}


def _twin_shape(cfg: dict) -> dict:
    """The twin in the words of a MindFormers model section (autopar.plan.shape)."""
    return {"hidden_size": cfg["hidden_size"], "num_layers": cfg["num_hidden_layers"],
            "num_heads": cfg["num_attention_heads"], "num_kv_heads": cfg["num_key_value_heads"],
            "ffn_hidden_size": cfg["intermediate_size"], "vocab_size": cfg["vocab_size"],
            "seq_length": SEQ}


def _twin_recompute(layers: int) -> tuple[str, ...]:
    """The file's selective recompute (the first n layers of each of its 8 stages) on the
    twin's stages: each twin stage stands for 8 / TWIN_PP of the file's stages and recomputes
    the mean of their counts, scaled to its layers."""
    counts = yaml.safe_load(MINDFORMERS.read_text())["recompute_config"]["select_recompute"]
    group, per_stage = len(counts) // TWIN_PP, layers // TWIN_PP
    file_per_stage = 80 // len(counts)
    modes = []
    for stage in range(TWIN_PP):
        mean = sum(counts[stage * group:(stage + 1) * group]) / group
        n = int(mean * per_stage / file_per_stage)
        modes += ["selective"] * n + ["none"] * (per_stage - n)
    return ("none", *modes, "none")  # head, layers, tail


def test_mindformers_llama2_70b_parallel_config_on_a_tiny_twin_equals_one_process(
        tmp_path) -> None:
    cfg = {**load_config("llama2-70b"), **TWIN}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    source, graph = describe_source(str(path)), autopar.capture(str(path), seq=SEQ)
    # the file's pins, then the scaled-down mesh, micro-batch count, model shape and
    # recompute (a later pin wins); its optimizer shard (ZeRO) has no data-parallel ranks to
    # shard over at dp=1; fp32 so that one process compares at 1e-4
    plan = autopar.plan(graph, devices=TWIN_PP * TWIN_TP, constraints=[
        str(MINDFORMERS), dict(dp=1, tp=TWIN_TP, pp=TWIN_PP, num_microbatches=4, zero_stage=0,
                               precision="fp32", model=_twin_shape(cfg),
                               recompute=_twin_recompute(cfg["num_hidden_layers"]))])
    # what the file states survives the scaling: sequence parallelism inside 1F1B pipeline
    # stages, one sequence per micro-batch, vocabulary-parallel embeddings, selective
    # recompute of the first layers of the first stage
    assert plan.mesh == {"pp": 2, "dp": 1, "cp": 1, "ep": 1, "tp": 2}
    assert (plan.sequence_parallel, plan.schedule, plan.microbatch_size,
            plan.num_microbatches, plan.global_batch) == (True, "1f1b", 1, 4, 4)
    assert tuple(plan.recompute) == _twin_recompute(cfg["num_hidden_layers"])
    assert "selective" in plan.recompute
    assert plan.placements["params"]["model.embed_tokens.weight"].startswith("Shard")
    _assert_equal_to_one_process(source, graph, plan)
