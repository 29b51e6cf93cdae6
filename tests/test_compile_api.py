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


def test_compile_writes_the_pipeline_program(tmp_path) -> None:
    graph = autopar.capture("tiny-llama", seq=32)
    plan = autopar.plan(graph, devices=4, global_batch=8,
                        constraints={"pp": 2, "tp": 2, "dp": 1, "sequence_parallel": False})
    out = autopar.compile("tiny-llama", None, plan, tmp_path / "art")
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "plan.yaml", "train.py"]
    text = (out / "train.py").read_text()
    from autopar.parallel.pipeline import chunk_ranges

    chunks = [list(c) for c in chunk_ranges(plan)]
    cut = ", ".join(f"{a}-{b - 1}" for a, b in chunks)
    assert f"schedule {plan.schedule}, chunks of blocks {cut} (chunk c on pp rank c % pp)" in text
    assert "def parallelize_stage(stage, mesh, plan, original):" in text
    manifest, _ = load_artifact(out)
    assert manifest["program"]["file"] == "train.py"
