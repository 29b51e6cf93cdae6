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


def test_cp_pins_read_from_a_megatron_command(tmp_path) -> None:
    args = tmp_path / "megatron.sh"
    args.write_text("torchrun --nnodes 4 --nproc-per-node 8 pretrain_gpt.py "
                    "--tensor-model-parallel-size 8 --pipeline-model-parallel-size 2 "
                    "--context-parallel-size 2 --cp-comm-type a2a+p2p "
                    "--micro-batch-size 1 --global-batch-size 16 --num-layers 32 "
                    "--decoder-first-pipeline-num-layers 15\n")
    pins = load_constraints(str(args))
    # 32 devices over tp 8 x pp 2 x cp 2: one data-parallel rank, 16 micro-batches
    assert pins["cp"] == 2 and pins["cp_mode"] == "hybrid" and pins["dp"] == 1
    assert pins["num_microbatches"] == 16
    assert pins["stage_layers"] == (15, 17)  # the last stage takes the rest
    # DeepSpeed-Ulysses' sequence_parallel_size: all-to-all context parallelism
    config = tmp_path / "ds_config.json"
    config.write_text('{"sequence_parallel_size": 4, "zero_optimization": {"stage": 2}}')
    ulysses = load_constraints(str(config))
    assert ulysses["cp"] == 4 and ulysses["cp_mode"] == "alltoall"
    with pytest.raises(autopar.PlanError, match="cp_mode must be one of"):
        load_constraints({"cp": 2, "cp_mode": "star"})
    with pytest.raises(autopar.PlanError, match="cp must be a positive integer"):
        load_constraints("cp=0")


def test_a_megatron_cp_command_plans_and_emits_it_back(tmp_path) -> None:
    from autopar.plan.megatron import megatron_command

    graph = autopar.capture("llama3-8b", seq=4096)
    pins = {"cp": 2, "cp_mode": "hybrid", "tp": 8, "pp": 2, "engine": "megatron"}
    plan = autopar.plan(graph, devices=32, cluster="h100-80g", global_batch=16,
                        constraints=pins)
    assert plan.mesh["cp"] == 2 and plan.mesh["dp"] == 1
    command = megatron_command(plan)
    assert "--context-parallel-size 2" in command and "--cp-comm-type a2a+p2p" in command
    # Megatron's accounting: 16 layers per stage, the embedding and head riding along
    layers = [i for i, b in enumerate(plan.model["blocks"]) if b["name"] not in ("head", "tail",
                                                                                  "root")]
    first_stage = [i for i in layers if plan.stages[0][0] <= i < plan.stages[0][1]]
    assert len(first_stage) == 16 and plan.stages[0][0] == 0


def test_one_layer_per_virtual_stage_plans_on_megatron() -> None:
    import torch

    from autopar.models.gpt import GPT, GPTConfig

    model = GPT(GPTConfig(n_layers=96, d_model=64, n_heads=4, seq_len=32))
    graph = autopar.capture(model, (torch.zeros(1, 32, dtype=torch.long),))
    assert len(graph.blocks) == 98  # the embedding and the head are blocks of their own
    plan = autopar.plan(graph, devices=8, global_batch=8,
                        constraints=dict(engine="megatron", pp=8, tp=1, schedule="interleaved",
                                         virtual_stages=12))
    assert plan.schedule == "interleaved" and plan.virtual_stages == 12
    # Megatron counts layers: 12 per stage, the embedding on the first, the head on the last
    sizes = [end - start for start, end in plan.stages]
    assert sizes == [13] + [12] * 6 + [13]
    # uneven first and last stages, as the Llama 3 paper's pipeline runs them
    uneven = autopar.plan(graph, devices=8, global_batch=8,
                          constraints=dict(engine="megatron", pp=8, tp=1, schedule="1f1b",
                                           stage_layers=[11, 13]))
    sizes = [end - start for start, end in uneven.stages]
    assert sizes == [12] + [12] * 6 + [14]
    from autopar.plan.megatron import constraints_from_megatron, megatron_command

    command = megatron_command(uneven)
    assert "--decoder-first-pipeline-num-layers 11" in command
    assert constraints_from_megatron(command)["stage_layers"] == [11, 13]
    with pytest.raises(autopar.PlanError, match="split evenly"):
        autopar.plan(graph, devices=8, global_batch=8,
                     constraints=dict(pp=8, tp=1, stage_layers=[10, 13]))
    explicit = autopar.plan(graph, devices=8, global_batch=8,
                            constraints=dict(pp=2, tp=1, stages=[[0, 40], [40, 98]]))
    assert explicit.stages == [[0, 40], [40, 98]]


def test_megatron_core_counts_the_embedding_and_the_loss_as_layers_when_chunks_need_it() -> None:
    """Llama 3.1 405B's 126 layers over pp8 x vp8 (Megatron-Bridge's published recipe) split
    only with the embedding and the loss counted as layers: 6 layers + 2 over pp2 x vp2 here.
    Megatron-Core runs it; Megatron-LM 2021 has no such flag and refuses it."""
    import torch

    from autopar.models.gpt import GPT, GPTConfig
    from autopar.plan.megatron import constraints_from_megatron, megatron_command

    model = GPT(GPTConfig(n_layers=6, d_model=64, n_heads=4, seq_len=32))
    graph = autopar.capture(model, (torch.zeros(1, 32, dtype=torch.long),))
    pins = dict(pp=2, tp=1, schedule="interleaved", virtual_stages=2)
    plan = autopar.plan(graph, devices=2, global_batch=4,
                        constraints=dict(pins, engine="megatron-core"))
    assert plan.schedule == "interleaved" and plan.virtual_stages == 2
    command = megatron_command(plan)
    assert "--num-virtual-stages-per-pipeline-rank 2" in command
    assert "--account-for-embedding-in-pipeline-split" in command
    assert "--account-for-loss-in-pipeline-split" in command
    back = constraints_from_megatron(command, engine="megatron-core")
    assert back["schedule"] == "interleaved" and back["virtual_stages"] == 2
    with pytest.raises(autopar.InfeasibleError, match="divisibility"):
        autopar.plan(graph, devices=2, global_batch=4, constraints=dict(pins, engine="megatron"))
