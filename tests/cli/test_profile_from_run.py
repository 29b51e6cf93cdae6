"""``autopar profile --from-run DIR``: a profile fitted to a profiled run predicts that run's
step as measured, loads as ``cluster=PATH`` for the next plan, and refuses what it cannot fit
from in one line."""

from __future__ import annotations

import json
import statistics

import pytest
import yaml

import autopar
from autopar.cost.hardware import load_cluster

from .test_inspect import _assert_one_line_error, cli_here
from .test_run import _torchrun

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def profiled_dp2(tmp_path_factory):
    """tiny Llama, dp2 on the CPU catalog, 7 steps, the profiler on steps 2..4 (step 1 its
    warm-up): steps 5 and 6 run unprofiled."""
    art = tmp_path_factory.mktemp("fromrun") / "dp2"
    made = cli_here("compile", "tiny-llama", "--devices", "2", "--seq", "32", "--global-batch",
                    "4", "--cluster", "cpu", "--constraints", "dp=2,pp=1,zero_stage=0",
                    "--out", str(art), "-q")
    assert made.returncode == 0, made.stderr
    ran = _torchrun(2, "run", str(art), "--steps", "7", "--device", "cpu", "--profile",
                    "--profile-steps", "2:5", "--quiet")
    assert ran.returncode == 0, ran.stderr[-3000:]
    return art


def test_the_fitted_profile_predicts_the_run_it_was_fitted_to(profiled_dp2, tmp_path) -> None:
    out = tmp_path / "fitted.yaml"
    result = cli_here("profile", "--from-run", str(profiled_dp2), "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert "fitted to 1 run(s)" in result.stdout and str(out) in result.stdout
    data = yaml.safe_load(out.read_text())
    run = data["calibration"]["runs"][0]
    records = [json.loads(x) for x in (profiled_dp2 / "logs" / "train.jsonl").read_text()
               .splitlines()]
    # the measured step: the median of the steps the profiler did not slow (5 and 6)
    assert run["measured_step_s"] == pytest.approx(
        statistics.median([records[5]["step_time_s"], records[6]["step_time_s"]]), rel=1e-3)
    measured, before, after = (run[k] for k in ("measured_step_s", "predicted_before_s",
                                                "predicted_after_s"))
    assert abs(after - measured) / measured < 0.02  # one run, the overhead fits it
    assert abs(after - measured) < abs(before - measured)
    # every number the fit changed says where it came from
    for key in ("kernel_overhead_s", "matmul_by_flops"):
        assert "--from-run" in data["sources"][key]
    # one gradient bucket size says nothing apart about latency and bandwidth: no fit made
    # up from it (tests/calibrate/test_fit.py recovers fits from calls of many sizes)
    assert data["calibration"]["samples"]["collective_calls"] >= 3
    assert "source" not in (data.get("collectives") or {}).get("all_reduce", {})
    cluster = load_cluster(out)  # a profile like any other: the next plan uses it
    assert cluster.device.efficiency.matmul_by_flops
    ran = autopar.Plan.load(profiled_dp2 / "plan.yaml")
    plan = autopar.plan("tiny-llama", devices=2, seq=32, global_batch=4, cluster=str(out),
                        constraints={"dp": 2, "pp": 1, "zero_stage": 0, "recompute": "none",
                                     "microbatch_size": ran.microbatch_size})
    assert plan.predicted.step_time_s == pytest.approx(after, rel=0.05)


def test_what_it_cannot_fit_from_is_refused_in_one_line(profiled_dp2, trained_pp2,
                                                          tmp_path) -> None:
    out = tmp_path / "never.yaml"
    art, _ = trained_pp2  # 4 steps, 1..3 profiled: none left unprofiled but the first
    _assert_one_line_error(cli_here("profile", "--from-run", str(art), "--out", str(out)),
                           "every step of the run was profiled")
    fresh = tmp_path / "fresh"
    assert cli_here("compile", "tiny-llama", "--devices", "1", "--seq", "32", "--cluster",
                    "cpu", "--out", str(fresh), "-q").returncode == 0
    _assert_one_line_error(cli_here("profile", "--from-run", str(fresh), "--out", str(out)),
                           "has no profile", "--profile")
    _assert_one_line_error(cli_here("profile", "--from-run", str(tmp_path / "nothing"),
                                    "--out", str(out)), "not an autopar artifact")
    _assert_one_line_error(cli_here("profile", "--base", "cpu", "--out", str(out)),
                           "--base goes with --from-run")
    assert not out.exists()
