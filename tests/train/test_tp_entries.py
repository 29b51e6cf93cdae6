"""A plan whose ``placements.fused`` or ``placements.heads`` entries a hand edit broke is
refused in one line: at load for what the plan alone shows, and against the model (autopar run,
Trainer, autopar.parallelize) before any work, instead of an IndexError on every rank."""

from __future__ import annotations

import copy

import pytest
import yaml

import autopar
from autopar.models.source import build_from_source, describe_source
from autopar.plan import Plan
from autopar.train.parallelize import check_tp_entries
from tests.fixtures.harness import run_in_group, spawn_ranks

from ..cli.test_inspect import _assert_one_line_error, cli_here

QKV = "model.layers.0.self_attn.qkv_proj"
ATTENTION = "model.layers.0.self_attn"
FIX = "restore the entry or re-plan with autopar compile"


@pytest.fixture(scope="module")
def phi3() -> dict:
    """A tp=2 plan of tiny-phi3 (fused qkv_proj and gate_up_proj), as plain data."""
    plan = autopar.plan(autopar.capture("tiny-phi3", seq=32), devices=2, global_batch=2,
                        constraints=dict(tp=2, pp=1))
    data = plan.to_dict()
    assert data["placements"]["fused"][QKV] == [64, 64, 64]
    assert data["placements"]["heads"][ATTENTION] == [4, 4, 16]
    return data


def _edited(data: dict, edit) -> dict:
    out = copy.deepcopy(data)
    edit(out["placements"])
    return out


def _one_line(exc: pytest.ExceptionInfo) -> str:
    text = str(exc.value)
    assert "\n" not in text and FIX in text
    return text


LOAD_EDITS = {
    "negative part": (lambda p: p["fused"].__setitem__(QKV, [64, -64, 64]),
                      f"placements.fused[{QKV}] is [64, -64, 64], not a list of positive"),
    "not a list": (lambda p: p["fused"].__setitem__(QKV, "64,64,64"),
                   "not a list of positive part widths"),
    "unplaced module": (lambda p: p["fused"].__setitem__("model.layers.0.mlp.fc9", [8, 8]),
                        "names model.layers.0.mlp.fc9, whose weight placements.params does "
                        "not place"),
    "heads not whole groups": (lambda p: p["heads"].__setitem__(ATTENTION, [4, 3, 16]),
                               "4 query heads, not a multiple of its 3 key/value heads"),
    "heads short": (lambda p: p["heads"].__setitem__(ATTENTION, [4, 4]),
                    "not [query heads, key/value heads, head size]"),
}


@pytest.mark.parametrize("edit", list(LOAD_EDITS))
def test_a_broken_entry_is_refused_at_load(phi3: dict, tmp_path, edit: str) -> None:
    change, needle = LOAD_EDITS[edit]
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(_edited(phi3, change)))
    with pytest.raises(autopar.PlanError) as exc:
        Plan.load(path)
    assert needle in _one_line(exc) and str(path) in str(exc.value)


def test_parts_tp_does_not_split_are_refused_only_where_the_plan_splits(phi3: dict) -> None:
    """Parts or heads that tp=2 cannot split whole are harmless while the module stays whole
    (the planner records the model's fused parts and heads whatever it splits) and refused
    once the plan splits it."""
    def odd(p: dict) -> None:
        p["fused"][QKV] = [63, 65, 64]
        p["heads"][ATTENTION] = [3, 3, 16]

    Plan.from_dict(_edited(phi3, odd))  # qkv_proj kept whole by the planner at this size
    for fqn in (f"{QKV}.weight", f"{ATTENTION}.o_proj.weight"):
        assert phi3["placements"]["params"][fqn] == "Replicate"

    def split(p: dict) -> None:  # column-split as the planner splits it at full size
        odd(p)
        p["params"][f"{QKV}.weight"] = "Shard(0)@tp"

    with pytest.raises(autopar.PlanError) as exc:
        Plan.from_dict(_edited(phi3, split))
    assert "has a part of 63 that tp=2 does not split whole" in _one_line(exc)

    def heads_only(p: dict) -> None:
        split(p)
        p["fused"][QKV] = [48, 48, 48]

    with pytest.raises(autopar.PlanError) as exc:
        Plan.from_dict(_edited(phi3, heads_only))
    assert f"placements.heads[{ATTENTION}] [3, 3, 16] cannot be split whole over tp=2" in \
        _one_line(exc)


MODEL_EDITS = {
    "parts": (lambda p: p["fused"].__setitem__(QKV, [64, 64, 32]),
              f"placements.fused[{QKV}] [64, 64, 32] adds up to 160, but the model's {QKV} "
              f"has 192 output features"),
    "missing attention": (lambda p: p["heads"].__setitem__("model.layers.7.self_attn",
                                                          [4, 4, 16]),
                          "placements.heads names model.layers.7.self_attn, which the model "
                          "does not have"),
    "head counts": (lambda p: p["heads"].__setitem__(ATTENTION, [2, 2, 32]),
                    "declares 4 query heads, the entry 2"),
    "head size": (lambda p: p["heads"].__setitem__(ATTENTION, [4, 4, 8]),
                  "declares 16 head size, the entry 8"),
}


@pytest.mark.parametrize("edit", list(MODEL_EDITS))
def test_an_entry_the_model_contradicts_is_refused(phi3: dict, edit: str) -> None:
    model = build_from_source(describe_source("tiny-phi3"), 0, "meta")
    check_tp_entries(model, Plan.from_dict(phi3))  # the plan as drawn matches
    change, needle = MODEL_EDITS[edit]
    plan = Plan.from_dict(_edited(phi3, change))  # loads: only the model shows it wrong
    with pytest.raises(autopar.PlanError) as exc:
        check_tp_entries(model, plan)
    assert needle in _one_line(exc)


def _parallelize_rank(rank: int, port: int, out, world: int, plan_dict: dict) -> None:
    run_in_group(rank, port, out, world, _parallelize_error, plan_dict)


def _parallelize_error(plan_dict: dict) -> str | None:
    import torch

    from autopar.errors import PlanError

    model = build_from_source(describe_source("tiny-phi3"), 0, "cpu").to(torch.float32)
    try:
        autopar.parallelize(model, Plan.from_dict(plan_dict))
    except PlanError as exc:
        return str(exc)
    return None


@pytest.mark.dist
def test_parallelize_refuses_parts_that_no_longer_match(phi3: dict) -> None:
    change, needle = MODEL_EDITS["parts"]
    [error] = spawn_ranks(_parallelize_rank, 2, (2, _edited(phi3, change)))
    assert error is not None and needle in error


def test_autopar_run_refuses_an_edited_plan_in_one_line(tmp_path) -> None:
    out = tmp_path / "art"
    made = cli_here("compile", "tiny-phi3", "--devices", "2", "--constraints", "tp=2,pp=1",
                    "--seq", "32", "--out", str(out), "-q")
    assert made.returncode == 0, made.stderr
    path = out / "plan.yaml"
    data = yaml.safe_load(path.read_text())
    data["placements"]["heads"][ATTENTION] = [4, 3, 16]
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    _assert_one_line_error(cli_here("run", str(out), "--steps", "1", "--device", "cpu"),
                           f"placements.heads[{ATTENTION}] [4, 3, 16]", "not a multiple", FIX)
