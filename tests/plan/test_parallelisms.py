"""The registry of parallelisms applied on top of the searched mesh (autopar.plan.parallelisms):
a registered one is priced and chosen by the search on its plan, pinned by a constraint,
recorded in plan.yaml and validated on load, and called by the generated program. A fake
parallelism is registered for each test; the toy of docs/architecture.md is used end to end in
tests/test_examples.py and its runtime in tests/parallel/test_toy_parallelism.py."""

from __future__ import annotations

import pytest

import autopar
from autopar.codegen import program_text
from autopar.errors import PlanError
from autopar.models.source import describe_source
from autopar.plan import parallelisms
from autopar.plan.parallelisms import Parallelism

SAVED_S = 1e-4  # per unit of the fake's value
HELD_BYTES = 2e6


def _supported(config) -> str | None:
    return None if config.dp > 1 else "it needs data parallelism"


def _price(graph, config, cluster, value: int) -> tuple[float, float]:
    return -SAVED_S * value, HELD_BYTES * value


FAKE = Parallelism("fake_depth", (0, 1, 2), "tests.fixtures.fake_depth", _supported, _price,
                   "a fake: each unit saves 0.1 ms and holds 2 MB")


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setattr(parallelisms, "PARALLELISMS", [FAKE])
    return FAKE


@pytest.fixture(scope="module")
def graph():
    return autopar.capture("tiny-llama", seq=16)


def _plan(graph, pins: str = "dp=2", **kw):
    return autopar.plan(graph, devices=2, cluster="cpu", global_batch=4, constraints=pins, **kw)


def test_the_search_takes_the_fastest_value_that_fits(fake, graph) -> None:
    off = _plan(graph, "dp=2,fake_depth=0")
    assert off.parallelisms == {}
    chosen = _plan(graph)
    assert chosen.parallelisms == {"fake_depth": 2}
    assert chosen.predicted.step_time_s == pytest.approx(off.predicted.step_time_s - 2 * SAVED_S,
                                                         abs=2e-6)
    assert chosen.predicted.memory["total"] == pytest.approx(
        off.predicted.memory["total"] + 2 * HELD_BYTES)
    assert chosen.predicted.breakdown["dp_comm_s"] == pytest.approx(
        off.predicted.breakdown.get("dp_comm_s", 0.0) - 2 * SAVED_S, abs=2e-6)
    assert chosen.predicted.mfu > off.predicted.mfu
    # a memory bound that holds one unit more than the plan without it, not two
    limit_gb = (off.predicted.memory["total"] + 1.5 * HELD_BYTES) / 1e9
    assert _plan(graph, memory_limit_gb=limit_gb).parallelisms == {"fake_depth": 1}
    assert _plan(graph, "dp=2,fake_depth=1").parallelisms == {"fake_depth": 1}


def test_pins_and_bad_constraints_fail_in_one_line(fake, graph) -> None:
    with pytest.raises(PlanError, match=r"fake_depth=2 does not apply to this plan \(it needs "
                                        r"data parallelism\)"):
        _plan(graph, "dp=1,tp=2,fake_depth=2")
    assert _plan(graph, "dp=1,tp=2").parallelisms == {}  # not supported: left out
    with pytest.raises(PlanError, match=r"fake_depth must be one of 0, 1, 2, got 3"):
        _plan(graph, "dp=2,fake_depth=3")
    with pytest.raises(PlanError, match=r"fake_depth must be one of 0, 1, 2, got True"):
        _plan(graph, {"dp": 2, "fake_depth": True})
    with pytest.raises(PlanError, match=r"unknown constraint 'fake_dept'.*fake_depth"):
        _plan(graph, "dp=2,fake_dept=1")
    with pytest.raises(PlanError, match="apply to training plans"):
        _plan(graph, "dp=2,fake_depth=1", task="infer")


def test_plan_files_keep_and_check_the_values(fake, graph, tmp_path, monkeypatch) -> None:
    plan = _plan(graph)
    loaded = autopar.Plan.load(plan.save(tmp_path / "plan.yaml"))
    assert loaded.parallelisms == {"fake_depth": 2}
    without = _plan(graph, "dp=2,fake_depth=0").save(tmp_path / "off.yaml")
    assert "parallelisms" not in without.read_text()  # plans without them read as before
    text = (tmp_path / "plan.yaml").read_text()
    for edit, message in (("fake_depth: 2", r"fake_depth must be one of 0, 1, 2, got 7"),
                          ("fake_depth: 2", r"'no_such' is not a registered parallelism")):
        bad = tmp_path / "bad.yaml"
        bad.write_text(text.replace(edit, "fake_depth: 7" if "7" in message else "no_such: 2"))
        with pytest.raises(PlanError, match=message):
            autopar.Plan.load(bad)
    monkeypatch.setattr(parallelisms, "PARALLELISMS", [])  # an autopar without it
    with pytest.raises(PlanError, match=r"'fake_depth' is not a registered parallelism \(none "
                                        r"are registered\); remove it, or re-plan"):
        autopar.Plan.load(tmp_path / "plan.yaml")


def test_the_program_imports_the_runtime_and_calls_apply(fake, graph) -> None:
    text = program_text(_plan(graph), describe_source("tiny-llama"))
    assert "from tests.fixtures import fake_depth\n" in text
    assert "    fake_depth.apply(model, mesh, plan, 2)\n" in text
    assert "# a fake: each unit saves 0.1 ms and holds 2 MB (fake_depth = 2)" in text
    compile(text, "train.py", "exec")
    plain = program_text(_plan(graph, "dp=2,fake_depth=0"), describe_source("tiny-llama"))
    assert "fake_depth" not in plain


def test_a_record_refuses_names_that_are_not_identifiers() -> None:
    with pytest.raises(ValueError, match="identifiers"):
        Parallelism("bad name", (0, 1), "tests.x", _supported, _price, "")
    with pytest.raises(ValueError, match="at least two values"):
        Parallelism("one", (0,), "tests.x", _supported, _price, "")


def test_the_report_and_diff_show_the_choice(fake, graph) -> None:
    from autopar.report import render
    from autopar.report.diff import plan_diff

    chosen, off = _plan(graph), _plan(graph, "dp=2,fake_depth=0")
    assert "fake_depth=2" in render(chosen, "text")
    assert "fake_depth" not in render(off, "text")
    changes = {c["field"]: (c["a"], c["b"]) for c in plan_diff(chosen, off)["changes"]}
    assert changes["parallelisms"] == ({"fake_depth": 2}, "none")
