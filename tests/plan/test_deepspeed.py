"""Plan -> DeepSpeed JSON -> constraints -> the same plan."""

from __future__ import annotations

import json

import pytest

import autopar
from autopar.plan.deepspeed import constraints_from_deepspeed, deepspeed_config

from ..cli.test_inspect import _assert_one_line_error, cli_here, run_cli

SAME = ("mesh", "zero_stage", "microbatch_size", "num_microbatches", "offload", "precision",
        "recompute")


@pytest.mark.parametrize("pins", [None, "zero3-only",
                                  dict(pp=2, tp=2, zero_stage=2, recompute="full",
                                       offload=["optimizer"])],
                         ids=["free", "zero3-only", "pp2-tp2-offload"])
def test_a_deepspeed_config_pins_the_same_plan(pins, tmp_path) -> None:
    graph = autopar.capture("llama3-8b", seq=4096)
    plan = autopar.plan(graph, devices=64, global_batch=512, constraints=pins)
    config = deepspeed_config(plan)
    assert config["train_batch_size"] == 512
    assert config["zero_optimization"]["stage"] == plan.zero_stage
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config))
    again = autopar.plan(graph, devices=64, global_batch=512, constraints=str(path))
    for field in SAME:
        assert getattr(again, field) == getattr(plan, field), field
    assert again.predicted.step_time_s == pytest.approx(plan.predicted.step_time_s, rel=0.02)
    assert constraints_from_deepspeed(config)["dp"] == plan.mesh["dp"] * plan.mesh["ep"]


def test_compile_emits_deepspeed_json(tmp_path) -> None:
    art = tmp_path / "art"
    made = run_cli("compile", "tiny-llama", "--devices", "2", "--seq", "32", "--global-batch",
                   "4", "--constraints", "dp=2,pp=1,zero_stage=3", "--emit", "deepspeed",
                   "--out", str(art), "-q")
    assert made.returncode == 0, made.stderr
    config = json.loads((art / "deepspeed.json").read_text())
    assert config["zero_optimization"]["stage"] == 3
    assert config["train_batch_size"] == 4
    _assert_one_line_error(cli_here("compile", "tiny-llama", "--devices", "2", "--emit",
                                   "megatron2", "--out", str(tmp_path / "x")), "--emit")
