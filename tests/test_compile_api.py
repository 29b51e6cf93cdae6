"""``autopar.compile(model, example_inputs, plan, out_dir)``."""

from __future__ import annotations

import json

import pytest

import autopar
from autopar.codegen import load_artifact
from autopar.models import GPT, GPTConfig, token_inputs


def test_compile_a_module_records_how_to_rebuild_it(tmp_path) -> None:
    model = GPT(GPTConfig(n_layers=2))
    plan = autopar.plan(autopar.capture(model, token_inputs(1, 64)), devices=2, global_batch=4)
    out = autopar.compile(model, None, plan, tmp_path / "art")
    manifest, loaded = load_artifact(out)
    assert manifest["model"]["kind"] == "class"
    assert manifest["model"]["config"]["n_layers"] == 2
    assert loaded.to_dict() == plan.to_dict()


def test_compile_refuses_a_foreign_directory_and_leaves_it_alone(tmp_path) -> None:
    model = GPT(GPTConfig(n_layers=1))
    plan = autopar.plan(autopar.capture(model, token_inputs(1, 64)), devices=1, global_batch=1)
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(autopar.PlanError, match="not an autopar artifact"):
        autopar.compile(model, None, plan, tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def test_recompiling_keeps_logs(tmp_path) -> None:
    model = GPT(GPTConfig(n_layers=1))
    plan = autopar.plan(autopar.capture(model, token_inputs(1, 64)), devices=1, global_batch=1)
    out = autopar.compile(model, None, plan, tmp_path / "art")
    (out / "logs").mkdir()
    (out / "logs" / "train.jsonl").write_text(json.dumps({"step": 0}) + "\n")
    autopar.compile(model, None, plan, out)
    assert (out / "logs" / "train.jsonl").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp left


def test_program_dumps_name_ranks_collectives_and_code(tmp_path) -> None:
    graph = autopar.capture("tiny-llama", seq=32)
    plan = autopar.plan(graph, devices=4, global_batch=8,
                        constraints={"pp": 2, "tp": 2, "dp": 1, "sequence_parallel": False})
    for fqn in plan.placements["params"]:  # a Megatron split, as a user might edit it in
        if fqn.endswith(("q_proj.weight", "up_proj.weight")):
            plan.placements["params"][fqn] = "Shard(0)@tp"
        elif fqn.endswith("o_proj.weight"):
            plan.placements["params"][fqn] = "Shard(1)@tp"
    out = autopar.compile("tiny-llama", None, plan, tmp_path / "art")
    stages = sorted((out / "programs").iterdir())
    assert [p.name for p in stages] == ["stage0.py.txt", "stage1.py.txt"]
    first, last = (p.read_text() for p in stages)
    assert "# runs on ranks [0, 1]" in first and "# runs on ranks [2, 3]" in last
    assert "send activations to the next stage" in first
    assert "recv activations from the previous stage" in last
    assert "all_reduce over tp(2) of model.layers.0.self_attn.o_proj's output" in first
    assert "def forward" in first and "lm_head" in last
