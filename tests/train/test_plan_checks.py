"""The runtime refuses, before any work, a plan that does not fit what it is given: module paths
the model does not have, other library releases than the ones planned with."""

from __future__ import annotations

import json

import pytest

import autopar
from autopar.artifact import library_versions, load_artifact
from autopar.models import GPT, GPTConfig
from autopar.models.source import describe_source
from autopar.train import Trainer

from ..cli.test_inspect import _assert_one_line_error, cli_here, run_cli


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-mixtral", "tiny-gpt2", "tiny-qwen2"])
def test_every_planned_parameter_exists_in_the_model(name: str) -> None:
    from autopar.models import build_model

    plan = autopar.plan(autopar.capture(name, seq=32), devices=1, cluster="cpu")
    have = {n for n, _ in build_model(name).named_parameters(remove_duplicate=False)}
    assert set(plan.placements["params"]) <= have


def test_a_plan_for_another_model_is_refused() -> None:
    plan = autopar.plan(autopar.capture("tiny-llama", seq=32), devices=1, cluster="cpu")
    other = describe_source(GPT(GPTConfig(vocab_size=256, seq_len=32, d_model=64, n_layers=2,
                                          n_heads=4)))
    with pytest.raises(autopar.PlanError, match="planned for another model"):
        Trainer(other, plan, program=None, device="cpu")


def test_other_library_releases_are_refused(tmp_path) -> None:
    art = tmp_path / "art"
    assert cli_here("compile", "tiny-llama", "--devices", "1", "--seq", "32", "--cluster", "cpu",
                   "--out", str(art), "-q").returncode == 0
    manifest = json.loads((art / "manifest.json").read_text())
    assert manifest["versions"] == library_versions()
    load_artifact(art)  # the same releases load
    manifest["versions"]["torch"] = "0.0.1"
    (art / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(autopar.PlanError, match="planned with torch 0.0.1"):
        load_artifact(art)
    _assert_one_line_error(run_cli("run", str(art), "--steps", "1", "--device", "cpu"),
                           "torch==0.0.1")
    assert not (art / "logs").exists()


def test_parallelize_refuses_what_it_does_not_apply_yet() -> None:
    model = GPT(GPTConfig(vocab_size=128, seq_len=32, d_model=64, n_layers=4, n_heads=4))
    from autopar.models import token_inputs

    graph = autopar.capture(model, token_inputs(1, 32))
    plan = autopar.plan(graph, devices=2, global_batch=4, constraints=dict(pp=2))
    plan.devices = 1  # as if launched right: the missing pipeline arguments are named
    plan.mesh = {**plan.mesh, "pp": 2}
    with pytest.raises(autopar.PlanError, match="example=.*loss_fn="):
        autopar.parallelize(model, plan)
    plan = autopar.plan(graph, devices=2, global_batch=4, constraints=dict(pp=1, dp=2))
    with pytest.raises(autopar.PlanError, match="torchrun --nproc-per-node 2"):
        autopar.parallelize(model, plan)
