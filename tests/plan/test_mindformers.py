"""MindFormers YAML -> constraints -> plan -> YAML."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

import autopar
from autopar.plan.mindformers import mindformers_yaml

from ..cli.test_inspect import _assert_one_line_error, cli_here, run_cli

# the parallel sections of a MindFormers Llama-2-70B training YAML, for 64 devices
MINDFORMERS = """
runner_config:
  batch_size: 1
parallel:
  enable_parallel_optimizer: True
parallel_config:
  data_parallel: 4
  model_parallel: 8
  pipeline_stage: 2
  expert_parallel: 1
  micro_batch_num: 16
  use_seq_parallel: False
  vocab_emb_dp: False
recompute_config:
  recompute: False
  select_recompute: True
"""


def test_a_mindformers_yaml_round_trips_through_a_plan(tmp_path) -> None:
    path = tmp_path / "llama2_70b.yaml"
    path.write_text(MINDFORMERS)
    graph = autopar.capture("llama2-70b", seq=4096)
    plan = autopar.plan(graph, devices=64, global_batch=64, constraints=str(path))
    assert plan.mesh == {"pp": 2, "dp": 4, "cp": 1, "tp": 8, "ep": 1}
    assert plan.num_microbatches == 16 and plan.microbatch_size == 1
    assert plan.zero_stage == 2  # the optimizer shard, as the runtime runs it under tp
    back = mindformers_yaml(plan)
    source = yaml.safe_load(MINDFORMERS)
    assert back["parallel_config"] == source["parallel_config"]
    assert back["runner_config"] == source["runner_config"]
    assert back["parallel"] == source["parallel"]
    assert back["recompute_config"]["select_recompute"]
    out = tmp_path / "again.yaml"
    out.write_text(yaml.safe_dump(back))
    again = autopar.plan(graph, devices=64, global_batch=64, constraints=str(out))
    assert (again.mesh, again.zero_stage, again.num_microbatches) == \
        (plan.mesh, plan.zero_stage, plan.num_microbatches)
    assert again.predicted.step_time_s == pytest.approx(plan.predicted.step_time_s, rel=1e-6)


REAL = Path(__file__).resolve().parent.parent / "fixtures" / "mindformers" / \
    "pretrain_llama2_70b_bf16_64p.yaml"


def test_a_real_mindformers_llama2_70b_yaml_runs_end_to_end(tmp_path) -> None:
    """MindFormers' Llama-2-70B YAML for 64 cards (dp 2, mp 4, pp 8, sequence parallel,
    parallel optimizer, per-stage selective recompute) pins the plan; planned for
    Megatron-LM, it comes out as Megatron arguments with the same layout and shape."""
    out = tmp_path / "art"
    made = run_cli("compile", "llama2-70b", "--devices", "64", "--constraints", str(REAL),
                   "--constraints", "engine=megatron", "--emit", "mindformers", "--out",
                   str(out), "-q", "--format", "json")
    assert made.returncode == 0, made.stderr
    plan = json.loads(made.stdout)
    assert plan["mesh"] == {"pp": 8, "dp": 2, "cp": 1, "tp": 4, "ep": 1} and plan["sequence_parallel"]
    # the YAML's batch: dp x runner batch x micro-batches, and its sequence length
    assert (plan["global_batch"], plan["microbatch_size"], plan["num_microbatches"]) == \
        (512, 1, 256)
    assert plan["model"]["inputs"]["input_ids"] == [1, 4096]
    assert plan["zero_stage"] == 1 and plan["engine"] == "megatron"  # MindSpore's = ZeRO-1
    assert plan["schedule"] == "1f1b" and plan["precision"]["compute"] == "bf16"
    assert plan["model"]["vocab_parallel"]  # vocab_emb_dp: False (embeddings split over mp)
    layers = plan["recompute"][1:-1]
    assert [layers[s * 10:(s + 1) * 10].count("selective") for s in range(8)] == \
        [10, 8, 6, 4, 2, 0, 0, 0]
    args = (out / "megatron.sh").read_text().split()
    for flag, value in (("--tensor-model-parallel-size", "4"),
                        ("--pipeline-model-parallel-size", "8"), ("--num-layers", "80"),
                        ("--hidden-size", "8192"), ("--ffn-hidden-size", "28672"),
                        ("--num-attention-heads", "64"), ("--num-query-groups", "8"),
                        ("--seq-length", "4096"), ("--global-batch-size", "512")):
        assert args[args.index(flag) + 1] == value, flag
    assert {"--sequence-parallel", "--use-distributed-optimizer", "--bf16"} <= set(args)
    back = yaml.safe_load((out / "mindformers.yaml").read_text())
    source = yaml.safe_load(REAL.read_text())
    for key in ("data_parallel", "model_parallel", "pipeline_stage", "micro_batch_num",
                "use_seq_parallel", "vocab_emb_dp"):
        assert back["parallel_config"][key] == source["parallel_config"][key], key
    assert back["recompute_config"]["select_recompute"] == \
        source["recompute_config"]["select_recompute"]
    # a Megatron-LM plan is not autopar's runtime's to run: no train.py, and run says so
    assert not (out / "train.py").exists()
    _assert_one_line_error(cli_here("run", str(out), "--steps", "1"), "megatron.sh",
                           "engine=autopar")


def test_the_mindformers_yaml_plans_for_autopars_runtime_and_refuses_another_model(
        tmp_path) -> None:
    # sequence parallelism inside pipeline stages runs on autopar's own runtime (a tiny twin
    # of this file's plan equals one process: tests/parallel/test_pipeline_sequence_parallel)
    made = cli_here("compile", "llama2-70b", "--devices", "64", "--constraints", str(REAL),
                    "--out", str(tmp_path / "a"), "-q")
    assert made.returncode == 0, made.stderr
    plan = autopar.Plan.load(tmp_path / "a" / "plan.yaml")
    assert plan.mesh == {"pp": 8, "dp": 2, "cp": 1, "ep": 1, "tp": 4}
    assert plan.sequence_parallel and (tmp_path / "a" / "train.py").exists()
    # its model section describes Llama-2-70B, not 7B
    _assert_one_line_error(cli_here("compile", "llama2-7b", "--devices", "64",
                                   "--constraints", str(REAL), "--constraints",
                                   "engine=megatron", "--out", str(tmp_path / "b"), "-q"),
                           "for another model", "hidden_size 8192 (the model has 4096)")
    assert not (tmp_path / "b").exists()


def test_a_mindformers_file_states_its_global_batch() -> None:
    """MindFormers trains data_parallel x micro_batch_num x batch_size sequences a step (each
    1 when absent); expert_parallel splits the data-parallel ranks rather than adding some."""
    from autopar.plan.mindformers import constraints_from_mindformers
    from autopar.search.api import default_global_batch

    real = constraints_from_mindformers(yaml.safe_load(REAL.read_text()))
    assert (real["dp"], real["ep"], real["microbatch_size"], real["num_microbatches"]) == \
        (2, 1, 1, 256)
    assert default_global_batch(real, 64) == 512
    bare = constraints_from_mindformers({"parallel_config": {"data_parallel": 8,
                                                             "model_parallel": 8}})
    assert default_global_batch(bare, 64) == 8  # one micro-batch of one sequence per replica
    moe = constraints_from_mindformers({"parallel_config": {
        "data_parallel": 8, "expert_parallel": 4, "micro_batch_num": 2},
        "runner_config": {"batch_size": 2}})
    assert (moe["dp"], moe["ep"]) == (2, 4) and default_global_batch(moe, 8) == 32
    with pytest.raises(ValueError, match="expert_parallel 4 does not divide data_parallel 6"):
        constraints_from_mindformers({"parallel_config": {"data_parallel": 6,
                                                          "expert_parallel": 4}})


def test_the_real_mindformers_yaml_plans_the_global_batch_it_states(tmp_path) -> None:
    """Without --global-batch the Llama-2-70B file plans its own 2 x 256 x 1 = 512; a
    --global-batch that contradicts it is refused in one line naming both."""
    args = ("compile", "llama2-70b", "--devices", "64", "--constraints", str(REAL), "-q")
    made = cli_here(*args, "--out", str(tmp_path / "a"))
    assert made.returncode == 0, made.stderr
    assert "global 512 = dp*ep 2 x micro-batch 1 x 256 micro-batches" in made.stdout
    plan = autopar.Plan.load(tmp_path / "a" / "plan.yaml")
    assert (plan.global_batch, plan.mesh["dp"], plan.microbatch_size,
            plan.num_microbatches) == (512, 2, 1, 256)
    _assert_one_line_error(cli_here(*args, "--global-batch", "64", "--out",
                                    str(tmp_path / "b")), "global batch 64", "512")
    assert not (tmp_path / "b").exists()
