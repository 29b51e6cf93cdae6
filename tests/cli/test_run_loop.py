"""``autopar run`` as people train: a schedule, a console line per step in a plain log,
evaluation, TensorBoard events, and a profile whose traces are valid Chrome trace JSON."""

from __future__ import annotations

import json
import math
import re

import pytest

from ..conftest import TRAINED_STEPS as STEPS
from .test_inspect import _assert_one_line_error, cli_here

pytestmark = pytest.mark.dist


def test_console_line_per_step_in_a_plain_log(trained_pp2) -> None:
    _, ran = trained_pp2
    lines = [ln for ln in ran.stdout.splitlines() if ln.startswith("step ")]
    assert len(lines) == STEPS
    for i, line in enumerate(lines, 1):
        assert re.fullmatch(rf"step {i}/{STEPS}  loss \d+\.\d{{4}}  lr \S+  \S+( k)? tok/s  "
                            rf"MFU \S+%  mem \S+ \S?B  ETA \d+:\d\d:\d\d", line), line
    assert "\x1b[" not in ran.stdout  # no terminal escapes in a log
    evals = [ln for ln in ran.stdout.splitlines() if ln.startswith("eval after step")]
    assert [ln.split()[3].rstrip(":") for ln in evals] == ["2", "4"]


def test_learning_rates_follow_the_schedule_and_evaluation_is_logged(trained_pp2) -> None:
    art, _ = trained_pp2
    records = [json.loads(x) for x in (art / "logs" / "train.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(STEPS))
    peak, floor = 2e-3, 2e-4
    want = [peak] + [floor + (peak - floor) * (1 + math.cos(math.pi * (s - 1) / 3)) / 2
                     for s in range(1, STEPS)]
    assert [r["lr"] for r in records] == pytest.approx(want, rel=1e-12)
    assert all(r["mfu"] > 0 and r["step_time_s"] > 0 for r in records)
    evals = [json.loads(x) for x in (art / "logs" / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [2, 4]
    assert all(e["perplexity"] == pytest.approx(math.exp(e["loss"])) and e["tokens"] == 2 * 4 * 32
               for e in evals)


def test_tensorboard_events_hold_the_run(trained_pp2) -> None:
    pytest.importorskip("tensorboard", reason="tensorboard is not installed here")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    art, _ = trained_pp2
    events = EventAccumulator(str(art / "logs" / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/tokens_per_s", "eval/loss"} <= tags
    assert [e.step for e in events.Scalars("train/loss")] == list(range(STEPS))
    records = [json.loads(x) for x in (art / "logs" / "train.jsonl").read_text().splitlines()]
    assert [e.value for e in events.Scalars("train/loss")] == \
        pytest.approx([r["loss"] for r in records], rel=1e-6)


def test_profile_traces_are_chrome_trace_json_with_the_steps(trained_pp2) -> None:
    art, ran = trained_pp2
    folder = art / "logs" / "profile"
    for rank in (0, 1):
        trace = json.loads((folder / f"rank{rank}.trace.json").read_text())
        assert isinstance(trace["traceEvents"], list)
        complete = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
        for e in complete:  # what Perfetto and chrome://tracing need of a complete event
            assert isinstance(e["name"], str) and e["dur"] >= 0
            assert isinstance(e["ts"], (int, float)) and "pid" in e and "tid" in e
        names = [e["name"] for e in complete]
        assert names.count("autopar.step") == 3  # steps 1..3, after a warm-up step
        assert "autopar.forward" in names and "autopar.optimizer" in names
        assert any(n.startswith("autograd::engine::evaluate_function") for n in names)
        assert any(n in ("c10d::send", "c10d::recv_", "gloo:send", "gloo:recv") for n in names)
        steps = sorted((e for e in complete if e["name"] == "autopar.step"),
                       key=lambda e: e["ts"])
        assert all(a["ts"] + a["dur"] <= b["ts"] for a, b in zip(steps, steps[1:],
                                                                   strict=False))
        # each profiled step's terms are a partition of that step: they add up to it
        mine = json.loads((folder / f"rank{rank}.summary.json").read_text())
        assert [sum(t.values()) for t in mine["steps"]] == \
            pytest.approx([e["dur"] * 1e-6 for e in steps], rel=1e-6)
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["window"] == [1, STEPS]
    assert [s["stage"] for s in summary["stages"]] == [0, 1]
    for stage in summary["stages"]:
        terms = stage["terms_s"]  # each term's median over the steps (not a partition)
        assert terms["forward"] > 0 and terms["backward"] > 0 and terms["optimizer"] > 0
        assert terms.get("comm:send_recv:pp", 0) > 0 and stage["peak_memory_bytes"] > 0
    assert "profiled steps 1..3" in ran.stdout


def test_bad_training_options_exit_2_and_write_nothing(tmp_path) -> None:
    art = tmp_path / "one"
    assert cli_here("compile", "tiny-llama", "--devices", "1", "--seq", "32", "--global-batch",
                    "2", "--cluster", "cpu", "--out", str(art), "-q").returncode == 0
    for args, needle in [
        (["--profile", "--profile-steps", "3:2"], "START < END"),
        (["--profile", "--profile-steps", "0:9"], "past this run's 4 steps"),
        (["--eval-every", "2"], "--eval PATH|synthetic"),
        (["--betas", "0.9"], "two numbers"),
        (["--warmup-steps", "9"], "warm-up steps exceed"),
        (["--lr-schedule", "cosine", "--min-lr", "1"], "min_lr within"),
        (["--eval", str(tmp_path / "missing")], "missing"),
    ]:
        result = cli_here("run", str(art), "--steps", "4", "--device", "cpu", *args)
        _assert_one_line_error(result, needle)
        assert not (art / "logs").exists(), args
