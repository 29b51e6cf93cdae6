"""``autopar.sweep``: one capture, each budget's plan exactly ``autopar.plan``'s, shape changes
named where (and only where) the plan's shape differs."""

from __future__ import annotations

import sys

import pytest

import autopar
from autopar.errors import InfeasibleError, PlanError
from autopar.search.sweep import devices_range


@pytest.fixture(scope="module")
def llama_graph():
    return autopar.capture("llama3-8b")


@pytest.fixture(scope="module")
def llama_rows(llama_graph):
    # a fixed global batch: a pipeline with some recompute at 8 devices, without at 16, ZeRO-3
    # at 128, tp=2 at 512 and smaller micro-batches forced at 1024
    return autopar.sweep(llama_graph, [8, 16, 64, 128, 512, 1024], global_batch=512)


def test_each_row_is_the_plan_for_that_budget_alone(monkeypatch) -> None:
    capture_module = sys.modules["autopar.search.api"]  # where the search calls the capture
    calls = []
    real = capture_module.capture
    monkeypatch.setattr(capture_module, "capture",
                        lambda *a, **k: calls.append(a) or real(*a, **k))
    rows = autopar.sweep("tiny-llama", [8, 1, 4, 2, 4], seq=64, global_batch=16)
    assert len(calls) == 1, "the model is captured once for all budgets"
    assert [r.devices for r in rows] == [1, 2, 4, 8]
    monkeypatch.setattr(capture_module, "capture", real)
    for row in rows:
        alone = autopar.plan("tiny-llama", devices=row.devices, seq=64, global_batch=16)
        assert row.plan.mesh == alone.mesh
        assert row.plan.predicted.step_time_s == alone.predicted.step_time_s
        assert row.plan.to_dict() == alone.to_dict()


def _differs(a, b) -> set[str]:
    """The shape fields that differ, read from the two plans directly."""
    out = {k for k in ("pp", "tp", "ep") if a.mesh[k] != b.mesh[k]}
    pipe = [(p.schedule, p.virtual_stages) if p.mesh["pp"] > 1 else None for p in (a, b)]
    for name, va, vb in (("zero_stage", a.zero_stage, b.zero_stage),
                         ("schedule", *pipe),
                         ("microbatch_size", a.microbatch_size, b.microbatch_size),
                         ("recompute", a.recompute, b.recompute),
                         ("offload", sorted(a.offload), sorted(b.offload)),
                         ("sequence_parallel", a.sequence_parallel, b.sequence_parallel)):
        if va != vb:
            out.add(name)
    return out


def test_changes_name_exactly_the_fields_that_differ(llama_rows) -> None:
    assert all(r.feasible for r in llama_rows)
    assert llama_rows[0].changes == []
    changed = []
    for before, after in zip(llama_rows, llama_rows[1:], strict=False):
        fields = {c["field"] for c in after.changes}
        assert fields == _differs(before.plan, after.plan), after.devices
        for c in after.changes:
            assert c["before"] != c["after"]
        changed.append(bool(fields))
    # both kinds occur, so the assertion above can fail either way
    assert any(changed) and not all(changed)
    # a budget that only grows dp (and so has fewer micro-batches) is not a change
    unchanged = [(a.plan, b.plan) for a, b in zip(llama_rows, llama_rows[1:], strict=False)
                 if not b.changes]
    assert any(a.mesh["dp"] != b.mesh["dp"] and a.num_microbatches != b.num_microbatches
               for a, b in unchanged)


def test_rows_as_data(llama_rows) -> None:
    row = llama_rows[-1].to_dict()
    plan = llama_rows[-1].plan
    assert row["devices"] == 1024 and row["feasible"] and row["mesh"] == plan.mesh
    assert row["predicted"]["step_time_s"] == plan.predicted.step_time_s
    assert row["predicted"]["tokens_per_s_per_device"] == pytest.approx(
        plan.predicted.tokens_per_s / 1024)
    # 512 sequences cannot give each of 1024 devices its own: the row says what that implies
    assert "512" in row["note"] and "dp x ep" in row["note"]
    assert llama_rows[0].to_dict()["note"] is None


def test_a_budget_without_a_plan_is_a_row_with_its_reason() -> None:
    # tp=2 cannot be pinned on one device; 6 sequences cannot be split over 4 replicas
    rows = autopar.sweep("tiny-llama", [1, 2, 4], seq=32, global_batch=6,
                         constraints="data-parallel-only")
    assert [r.feasible for r in rows] == [True, True, False]
    with pytest.raises(InfeasibleError) as alone:
        autopar.plan("tiny-llama", devices=4, seq=32, global_batch=6,
                     constraints="data-parallel-only")
    assert rows[2].reason == str(alone.value) and "global batch 6" in rows[2].reason
    assert rows[2].to_dict()["reason"] == rows[2].reason and rows[2].changes == []
    assert "dp x ep must divide 6" in rows[2].note

    rows = autopar.sweep("tiny-llama", [1, 2], seq=32, constraints="tp=2")
    assert not rows[0].feasible and "tp=2 does not divide 1 devices" in rows[0].reason
    assert rows[1].plan.mesh["tp"] == 2 and rows[1].changes == []


def test_devices_range_and_bad_budgets() -> None:
    assert devices_range(8, 1024) == [8, 16, 32, 64, 128, 256, 512, 1024]
    assert devices_range(6, 100) == [6, 12, 24, 48, 96]
    assert devices_range(4, 4) == [4]
    with pytest.raises(PlanError):
        devices_range(8, 4)
    with pytest.raises(PlanError):
        devices_range(0, 4)
    for bad in ([], [0, 8], [2.0]):
        with pytest.raises(PlanError, match="devices"):
            autopar.sweep("tiny-llama", bad, seq=32)
    # an input that every budget refuses alike is an error, not a table of refusals
    with pytest.raises(PlanError, match="memory_limit_gb must be positive"):
        autopar.sweep("tiny-llama", [1, 2], seq=32, memory_limit_gb=-1)
