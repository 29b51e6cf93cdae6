"""The generated training program: what compile writes is what runs, directly under torchrun
or through ``autopar run``; a plan edit regenerates it, a hand edit is kept and said."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

import autopar
from autopar.codegen import load_program, program_text
from autopar.models.source import describe_source

from ..cli.test_inspect import _assert_one_line_error, cli_here, run_cli

pytestmark = pytest.mark.dist


def _compile(art, constraints: str, devices: int = 2) -> None:
    made = cli_here("compile", "tiny-llama", "--devices", str(devices), "--seq", "32",
                    "--global-batch", "4", "--cluster", "cpu", "--constraints", constraints,
                    "--out", str(art), "-q")
    assert made.returncode == 0, made.stderr


def _losses(art) -> list[float]:
    log = art / "logs" / "train.jsonl"
    return [json.loads(line)["loss"] for line in log.read_text().splitlines()]


def _torchrun(nproc: int, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", str(nproc), *args],
                          capture_output=True, text=True, timeout=240)


def test_the_program_states_the_plan() -> None:
    """Each piece of the plan appears as a statement: mesh, styles, recompute, ZeRO, optimizer
    (read from the planner's own plan, whatever it chose)."""
    graph = autopar.capture("tiny-llama", seq=32)
    plan = autopar.plan(graph, devices=4, global_batch=8, cluster="cpu",
                        constraints=dict(tp=2, dp=2, pp=1, zero_stage=3, recompute="full"))
    text = program_text(plan, describe_source("tiny-llama"))
    assert 'init_device_mesh(device, (2, 2), mesh_dim_names=("dp", "tp"))' in text  # in use
    assert "reshard_after_forward=True" in text  # ZeRO-3
    assert 'RECOMPUTE = {"transformer": "full"}' in text  # a rule by block type
    assert "parallelize_module(" in text
    split = [k for k, v in plan.placements["params"].items() if "@tp" in v]
    for fqn in split:  # every module the plan splits has its style line
        assert f'"{fqn.rsplit(".", 1)[0].split(".")[-1]}"' in text or \
            f'"{fqn.rsplit(".", 1)[0]}"' in text
    module = load_program(text)
    assert callable(module.parallelize) and callable(module.build_optimizer)


def test_torchrun_runs_the_program_file_and_edits_are_kept(tmp_path) -> None:
    art = tmp_path / "art"
    _compile(art, "dp=2,pp=1,zero_stage=2")
    program = art / "train.py"
    ran = _torchrun(2, str(program), "--steps", "2", "--device", "cpu")
    assert ran.returncode == 0, ran.stderr[-2000:]
    direct = _losses(art)
    assert len(direct) == 2
    # a hand edit is kept, and said: this one halves the learning rate
    text = program.read_text().replace("torch.optim.AdamW(param_groups, lr=hp.lr,",
                                       "torch.optim.AdamW(param_groups, lr=hp.lr * 0.5,")
    program.write_text(text)
    (art / "logs" / "train.jsonl").unlink()
    ran = _torchrun(2, "-m", "autopar", "run", str(art), "--steps", "2", "--device", "cpu",
                    "--overwrite")
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert "edited by hand" in ran.stderr
    assert program.read_text() == text  # kept
    edited = _losses(art)
    assert edited[0] == pytest.approx(direct[0], rel=1e-6)  # same start
    assert edited[1] != pytest.approx(direct[1], rel=1e-6)  # the edit ran
    # a syntax error in the edited program: one line, exit 2, nothing run
    program.write_text(text + "\ndef broken(:\n")
    _assert_one_line_error(cli_here("run", str(art), "--steps", "1", "--device", "cpu"),
                           "train.py:")


def test_an_edited_plan_regenerates_the_program(tmp_path) -> None:
    art = tmp_path / "art"
    _compile(art, "dp=1,pp=1", devices=1)
    before = (art / "train.py").read_text()
    plan = yaml.safe_load((art / "plan.yaml").read_text())
    plan["recompute"] = ["full" if b["name"] not in ("head", "tail") else "none"
                         for b in plan["model"]["blocks"]]
    (art / "plan.yaml").write_text(yaml.safe_dump(plan, sort_keys=False))
    ran = run_cli("run", str(art), "--steps", "1", "--device", "cpu")
    assert ran.returncode == 0, ran.stderr
    assert "regenerated" in ran.stderr
    after = (art / "train.py").read_text()
    assert after != before and 'RECOMPUTE = {"transformer": "full"}' in after
    ran = run_cli("run", str(art), "--steps", "1", "--device", "cpu", "--overwrite")
    assert ran.returncode == 0 and "regenerated" not in ran.stderr  # now up to date


def test_no_value_from_a_plan_or_config_becomes_code() -> None:
    """Names that reach the program's docstring and comments (the cluster, the model's
    architecture from config.json) cannot close them: whatever they hold stays text."""
    import ast
    import dataclasses

    from autopar.codegen import generate_program_text

    graph = autopar.capture("tiny-llama", seq=32)
    hostile = 'x"""\nopen("canary", "w")\n"""\n# \nopen("canary", "w")'
    source = describe_source("tiny-llama")
    source["config"] = dict(source["config"], architectures=[hostile])
    for task in ("train", "infer"):
        plan = autopar.plan(graph, devices=2, global_batch=4, task=task,
                            constraints={"tp": 2, "dp": 1})
        plan = dataclasses.replace(plan, cluster=hostile)  # in memory: no file check ran
        text = (program_text(plan, source) if task == "train"
                else generate_program_text(plan, source))
        calls = [node.func.id for node in ast.walk(ast.parse(text))
                 if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)]
        assert "open" not in calls, task
        assert "canary" not in text.replace("?canary?", ""), task


def test_the_recompute_rule_gives_every_layer_its_planned_mode() -> None:
    """RECOMPUTE is written as a rule (a mode per block type, the layers that differ as index
    ranges); the program's helper expands it back to exactly the plan's per-layer modes, and
    a key naming nothing is refused in one line."""
    import dataclasses

    from autopar.codegen.program import recompute_rule
    from autopar.errors import PlanError
    from autopar.models.source import build_from_source
    from autopar.parallel import program_steps as ap

    graph = autopar.capture("tiny-llama", seq=32)
    plan = autopar.plan(graph, devices=1, global_batch=4, cluster="cpu")
    model = build_from_source(describe_source("tiny-llama"), seed=0, device="meta")
    for modes, rule in (
            (["none", "none", "op", "op", "none", "none"],
             {"transformer": "none", "model.layers.1-2": "op"}),
            (["none", "full", "full", "selective", "full", "none"],
             {"transformer": "full", "model.layers.2": "selective"})):
        planned = dataclasses.replace(plan, recompute=modes)
        assert recompute_rule(planned) == rule
        wanted = {b.name: m for b, m in zip(planned.model.blocks, modes, strict=True)
                  if b.is_layer and m != "none"}
        assert ap.recompute_modes(model, planned, rule) == wanted
        text = program_text(planned, describe_source("tiny-llama"))
        assert "RECOMPUTE = " + json.dumps(rule) in text  # the rule, as written
    with pytest.raises(PlanError, match="RECOMPUTE names 'model.layer.1'") as err:
        ap.recompute_modes(model, plan, {"model.layer.1": "op"})
    assert "\n" not in str(err.value)
