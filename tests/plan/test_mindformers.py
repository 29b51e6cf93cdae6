"""MindFormers YAML -> constraints -> plan -> YAML."""

from __future__ import annotations

import pytest
import yaml

import autopar
from autopar.plan.mindformers import mindformers_yaml

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
recompute_config:
  recompute: False
  select_recompute: True
"""


def test_a_mindformers_yaml_round_trips_through_a_plan(tmp_path) -> None:
    path = tmp_path / "llama2_70b.yaml"
    path.write_text(MINDFORMERS)
    graph = autopar.capture("llama2-70b", seq=4096)
    plan = autopar.plan(graph, devices=64, global_batch=64, constraints=str(path))
    assert plan.mesh == {"pp": 2, "dp": 4, "tp": 8, "ep": 1}
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
