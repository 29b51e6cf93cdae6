"""``autopar sweep`` as a user runs it: its table, JSON and HTML, and every error path."""

from __future__ import annotations

import json
import re

import pytest

import autopar
from autopar.report import fmt

from .test_inspect import _assert_one_line_error, cli_here, run_cli

TINY = ["sweep", "tiny-llama", "--seq", "64", "--global-batch", "16"]


@pytest.fixture(scope="module")
def alone() -> dict[int, autopar.Plan]:
    """What `autopar.plan` returns for each budget by itself."""
    graph = autopar.capture("tiny-llama", seq=64)
    return {n: autopar.plan(graph, devices=n, global_batch=16) for n in (1, 2, 4, 8)}


def test_text_table_has_a_row_per_budget_and_names_the_changes(alone) -> None:
    result = run_cli(*TINY, "--devices", "1..8")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("autopar sweep: llama (217,664 params), train on 1 to 8 x "
                               "a100-80g")
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["devices", "mesh"])
    rows = lines[header + 1:header + 5]
    assert [int(r.split()[0]) for r in rows] == [1, 2, 4, 8]
    for devices, row in zip((1, 2, 4, 8), rows, strict=True):
        plan = alone[devices]
        assert fmt.mesh(plan.mesh) in row
        assert fmt.seconds(plan.predicted.step_time_s) in row
    assert rows[0].rstrip().endswith("%)")  # the first row has nothing to compare against
    # the second row names what changed from the first (each budget planned alone)
    before, after = alone[1].microbatch_size, alone[2].microbatch_size
    assert before != after and f"micro-batch {before} -> {after}" in rows[1]
    assert re.search(r"captured in [\d.]+ s, planned 4 budgets in [\d.]+ s", result.stderr)


def test_json_rows_are_the_plans_of_each_budget_alone(alone, tmp_path) -> None:
    out = tmp_path / "sweep.json"
    result = cli_here(*TINY, "--devices", "2,8,4", "--out", str(out), "-q")
    assert result.returncode == 0 and result.stdout == "" and result.stderr == ""
    data = json.loads(out.read_text())
    assert [r["devices"] for r in data["rows"]] == [2, 4, 8]
    previous = None
    for row in data["rows"]:
        plan = alone[row["devices"]]
        assert row["feasible"] and row["mesh"] == plan.mesh
        assert row["predicted"]["step_time_s"] == plan.predicted.step_time_s
        assert row["microbatch_size"] == plan.microbatch_size
        assert row["recompute"] == plan.recompute_counts()
        if previous is not None:  # the micro-batch shrinks with the budget: each row says so
            assert previous.microbatch_size != plan.microbatch_size
            assert {"field": "microbatch_size", "before": previous.microbatch_size,
                    "after": plan.microbatch_size} in row["changes"]
        previous = plan
    assert [p.name for p in tmp_path.iterdir()] == ["sweep.json"]  # no temporary file left


def test_html_is_self_contained_with_the_figure(tmp_path) -> None:
    out = tmp_path / "sweep.html"
    result = cli_here(*TINY, "--devices", "1,2,4,8,16", "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert f"wrote {out}" in result.stderr
    html = out.read_text()
    assert html.startswith("<!doctype html>") and "<style>" in html
    images = re.findall(r'<img alt="([^"]+)" src="data:image/png;base64,([A-Za-z0-9+/=]+)"', html)
    assert [alt for alt, _ in images] == [
        "throughput, MFU and memory per device against the device budget"]
    assert len(images[0][1]) > 20_000
    assert not re.search(r'(src|href)="(https?:)?//', html) and "<script" not in html
    table = html.split('<section id="sweep">')[1].split("</section>")[0]
    assert table.count("<tr>") == 1 + 5
    # the last budget's row names its change from the one before (planned alone)
    graph = autopar.capture("tiny-llama", seq=64)
    eight, sixteen = (autopar.plan(graph, devices=n, global_batch=16) for n in (8, 16))
    assert eight.microbatch_size != sixteen.microbatch_size
    assert f"micro-batch {eight.microbatch_size} -&gt; {sixteen.microbatch_size}" in table


def test_an_infeasible_budget_is_a_row_with_its_reason() -> None:
    result = cli_here("sweep", "llama3-70b", "--devices", "1,8", "-q")
    assert result.returncode == 0, result.stderr
    rows = {line.split()[0]: line for line in result.stdout.splitlines()
            if line.split()[:1] in (["1"], ["8"])}
    assert re.search(r"no plan: no plan fits [\d.]+ GB per device on 1 x a100-80g", rows["1"])
    assert re.search(r"use more (tensor-parallel )?devices", rows["1"])  # the way out survives
    # the shortening
    assert "no plan" not in rows["8"] and "pp=" in rows["8"]


def test_bad_inputs_exit_2_with_one_line_and_write_nothing(tmp_path) -> None:
    out = tmp_path / "never.html"
    base = [*TINY, "--out", str(out)]
    _assert_one_line_error(run_cli(*base, "--devices", "8,x"), "--devices", "'x'")
    for bad, needle in (("0", "at least 1"), ("", "''"), ("8..4", "8..4"), ("8,,16", "''"),
                        ("-2", "at least 1"), ("a..8", "'a..8'")):
        _assert_one_line_error(cli_here(*base, "--devices", bad), "--devices", needle)
    _assert_one_line_error(cli_here(*TINY, "--out", str(out)), "--devices")
    _assert_one_line_error(cli_here(*base, "--devices", "4", "--constraints", "nope=1"), "nope")
    _assert_one_line_error(cli_here(*base, "--devices", "4", "--cluster", "tpu-v9"), "tpu-v9")
    _assert_one_line_error(cli_here(*TINY, "--devices", "4", "--out", str(tmp_path / "no" / "x")),
                           "does not exist")
    # no budget has a plan: one line naming the budgets and the last one's reason
    _assert_one_line_error(cli_here(*base, "--devices", "2,4", "--memory-limit-gb", "0.0001"),
                           "no plan for any of the 2 budgets (2, 4 devices)", "no plan fits")
    assert list(tmp_path.iterdir()) == []


def test_help_lists_sweep() -> None:
    result = cli_here("--help")
    assert result.returncode == 0 and "autopar sweep llama3-8b --devices 8..1024" in \
        result.stdout and re.search(r"^\s+sweep\s", result.stdout, re.M)
