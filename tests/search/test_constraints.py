"""Constraints from several sources merged in order; pins on the embedding layout and on the
model's shape."""

from __future__ import annotations

import pytest

import autopar
from autopar.search.constraints import load_constraints


def test_constraints_merge_in_order_and_translate_for_the_pinned_engine(tmp_path) -> None:
    args = tmp_path / "megatron.sh"
    args.write_text("torchrun --nnodes 2 --nproc-per-node 8 pretrain_gpt.py "
                    "--tensor-model-parallel-size 4 --pipeline-model-parallel-size 2 "
                    "--micro-batch-size 1 --global-batch-size 64 --use-distributed-optimizer "
                    "--num-layers 32 --hidden-size 4096\n")
    # the distributed optimizer is ZeRO-1; autopar's runtime runs it as ZeRO-2 under tp
    assert load_constraints(str(args))["zero_stage"] == 2
    pinned = load_constraints([str(args), "engine=megatron", "pp=1"])
    assert pinned["zero_stage"] == 1 and pinned["engine"] == "megatron"
    assert pinned["pp"] == 1 and pinned["tp"] == 4  # a later pin wins
    assert pinned["model"] == {"num_layers": 32, "hidden_size": 4096}


def test_vocab_parallel_false_keeps_embedding_tables_whole() -> None:
    graph = autopar.capture("llama3-8b", seq=1024)
    pins = dict(tp=8, pp=1, sequence_parallel=False)
    split = autopar.plan(graph, devices=8, global_batch=8, constraints=pins)
    whole = autopar.plan(graph, devices=8, global_batch=8,
                         constraints=dict(pins, vocab_parallel=False))
    table = "model.embed_tokens.weight"
    assert "@tp" in split.placements["params"][table] and split.model["vocab_parallel"]
    assert "@tp" not in whole.placements["params"][table]
    assert not whole.model["vocab_parallel"]
    # a whole table per rank: more memory for the parameters
    assert whole.predicted.memory["params"] > split.predicted.memory["params"]


def test_a_pinned_model_shape_must_match_the_model() -> None:
    graph = autopar.capture("tiny-llama", seq=32)
    plan = autopar.plan(graph, devices=1, constraints={"model": {"hidden_size": 64,
                                                                 "num_layers": 4}})
    assert plan.model["shape"]["hidden_size"] == 64
    with pytest.raises(autopar.PlanError, match="another model.*num_layers 80"):
        autopar.plan(graph, devices=1, constraints={"model": {"num_layers": 80}})
    with pytest.raises(autopar.PlanError, match="model must map"):
        load_constraints({"model": {"layers": 80}})


def test_seq_of_a_named_model_comes_from_the_call_or_the_pinned_shape() -> None:
    assert autopar.plan("tiny-llama", devices=1, seq=16).model["inputs"]["input_ids"] == [1, 16]
    pinned = autopar.plan("tiny-llama", devices=1, constraints={"model": {"seq_length": 24}})
    assert pinned.model["inputs"]["input_ids"] == [1, 24]
