"""The plan file: deterministic, round-trips, and refuses inconsistent edits."""

from __future__ import annotations

import pytest
import yaml

import autopar
from autopar.plan import PLAN_VERSION, Plan


@pytest.fixture(scope="module")
def graph():
    return autopar.capture("tiny-llama", seq=64)


@pytest.fixture(scope="module")
def plan(graph):
    return autopar.plan(graph, devices=4, global_batch=16)


def test_same_inputs_give_byte_identical_files(graph, tmp_path) -> None:
    a = autopar.plan(graph, devices=4, global_batch=16).save(tmp_path / "a.yaml")
    again = autopar.capture("tiny-llama", seq=64)  # a fresh capture too
    b = autopar.plan(again, devices=4, global_batch=16).save(tmp_path / "b.yaml")
    assert a.read_bytes() == b.read_bytes()


def test_round_trip(plan, tmp_path) -> None:
    path = plan.save(tmp_path / "plan.yaml")
    loaded = Plan.load(path)
    assert loaded.to_dict() == plan.to_dict()
    assert loaded.mesh == plan.mesh and loaded.predicted.step_time_s == plan.predicted.step_time_s
    data = yaml.safe_load(path.read_text())
    for key in ("version", "mesh", "microbatch_size", "num_microbatches", "zero_stage",
                "schedule", "recompute", "offload", "stages", "placements", "predicted",
                "alternatives", "solver"):
        assert key in data
    assert data["version"] == PLAN_VERSION
    assert len(data["recompute"]) == len(data["model"]["blocks"])
    assert set(data["placements"]["params"]) == set(autopar.capture("tiny-llama",
                                                                    seq=64).params)


def _edited(plan, tmp_path, **changes):
    data = plan.to_dict()
    data.update(changes)
    path = tmp_path / "edited.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_inconsistent_edits_are_refused(plan, tmp_path) -> None:
    bad_mesh = dict(plan.mesh, dp=plan.mesh["dp"] * 2)
    with pytest.raises(autopar.PlanError, match="covers"):
        Plan.load(_edited(plan, tmp_path, mesh=bad_mesh))
    with pytest.raises(autopar.PlanError, match="version"):
        Plan.load(_edited(plan, tmp_path, version=PLAN_VERSION + 1))
    with pytest.raises(autopar.PlanError, match="one mode per block"):
        Plan.load(_edited(plan, tmp_path, recompute=["none"]))
    with pytest.raises(autopar.PlanError, match="global_batch"):
        Plan.load(_edited(plan, tmp_path, global_batch=plan.global_batch + 1))
    with pytest.raises(autopar.PlanError, match=r"recompute\.0: input should be 'none'"):
        Plan.load(_edited(plan, tmp_path, recompute=["sometimes"] * len(plan.recompute)))
    with pytest.raises(autopar.PlanError, match="missing or unknown field"):
        Plan.load(_edited(plan, tmp_path, surprise=1))
    broken = tmp_path / "broken.yaml"
    broken.write_text("mesh: [unclosed")
    with pytest.raises(autopar.PlanError, match="not valid YAML"):
        Plan.load(broken)
    with pytest.raises(autopar.PlanError, match="cannot read plan"):
        Plan.load(tmp_path / "missing.yaml")


def test_hand_edited_plan_still_loads(plan, tmp_path) -> None:
    modes = ["full"] * len(plan.recompute)
    loaded = Plan.load(_edited(plan, tmp_path, recompute=modes))
    assert loaded.recompute == modes


def test_text_report_shows_the_numbers(plan) -> None:
    text = plan.report()
    assert f"pp={plan.mesh['pp']} dp={plan.mesh['dp']}" in text
    assert "MFU" in text and "gap" in text and "runner-ups" in text


def test_format_1_files_load_and_save_as_the_current_format(plan, tmp_path) -> None:
    data = plan.to_dict()
    data["version"] = 1
    data.pop("explain")
    for key in ("breakdown", "pipeline_s", "p2p_s", "optimizer_s", "offload_s", "model_flops"):
        data["predicted"].pop(key)
    old = tmp_path / "v1.yaml"
    old.write_text(yaml.safe_dump(data))
    loaded = Plan.load(old)
    assert loaded.mesh == plan.mesh and loaded.explain == {} and loaded.predicted.breakdown == {}
    saved = yaml.safe_load(loaded.save(tmp_path / "v2.yaml").read_text())
    assert saved["version"] == PLAN_VERSION == 3


def test_the_plan_records_what_the_report_needs(plan) -> None:
    p = plan.predicted
    assert sum(p.breakdown.values()) == pytest.approx(p.step_time_s, rel=1e-4)
    assert all({"bubble_s", "recompute_s", "weight_grad_s"} <= set(s) for s in p.stages)
    assert {"memory", "divisibility", "batch", "constraints"} <= set(plan.solver["bounds"])
    types = plan.explain["block_types"]
    assert sorted(int(t) for t in types) == sorted({b["type"] for b in plan.model["blocks"]})
    for a in plan.alternatives:
        assert sum(a["breakdown"].values()) == pytest.approx(a["step_time_s"], rel=1e-4)


def test_field_types_and_ranges_are_checked_on_load(plan, tmp_path) -> None:
    """Every field is checked strictly (a string is not a number, a bool not an int) and
    choices and names are what they must be, each in one line naming the field."""
    cases = {
        "mesh.pp: input should be a valid integer, got 'one'": dict(mesh=dict(plan.mesh, pp="one")),
        "mesh.tp: input should be a valid integer, got '1'": dict(mesh=dict(plan.mesh, tp="1")),
        "devices: input should be a valid integer, got True": dict(devices=True),
        "global_batch: input should be greater than or equal to 1": dict(global_batch=0),
        "schedule: input should be 'gpipe'": dict(schedule="fastest"),
        "cluster: must be a cluster name": dict(cluster='a100"""\nopen("canary", "w")\n"""'),
        "offload.0: input should be 'optimizer'": dict(offload=["disk"]),
        "placements.params.lm_head.weight: must be a placement": dict(
            placements=dict(plan.placements, params=dict(
                plan.placements["params"], **{"lm_head.weight": "Shard(0)@tp)\nimport os"}))),
        "model.inputs.input_ids.1: input should be a valid integer": dict(
            model=dict(plan.model, inputs={"input_ids": [1, "64)\nimport os"]})),
        "predicted is missing": dict(predicted=None),
    }
    for expected, change in cases.items():
        data = plan.to_dict()
        data.update(change)
        if data["predicted"] is None:
            del data["predicted"]
        path = tmp_path / "edited.yaml"
        path.write_text(yaml.safe_dump(data))
        with pytest.raises(autopar.PlanError) as err:
            Plan.load(path)
        assert expected in str(err.value) and "\n" not in str(err.value), str(err.value)
