"""What ``autopar run`` leaves on disk: checkpoints kept as asked (``--keep-last``,
``--no-final-save``), an earlier run's checkpoints never replaced unasked (``--overwrite``),
one log per run (earlier runs' logs moved to logs/runs/<run id>, a resumed run going on with
its own)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .test_inspect import _assert_one_line_error, cli_here


@pytest.fixture()
def art(tmp_path) -> Path:
    out = tmp_path / "art"
    made = cli_here("compile", "tiny-llama", "--devices", "1", "--seq", "16", "--global-batch",
                    "2", "--cluster", "cpu", "--out", str(out), "-q")
    assert made.returncode == 0, made.stderr
    return out


def _run(art: Path, *args: str):
    return cli_here("run", str(art), "--device", "cpu", "-q", *args)


def _steps(art: Path) -> list[str]:
    return sorted(p.name for p in (art / "checkpoints").glob("step_*"))


def _records(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_checkpoints_are_kept_as_asked_and_never_replaced_unasked(art) -> None:
    ran = _run(art, "--steps", "4", "--checkpoint-every", "1", "--keep-last", "2")
    assert ran.returncode == 0, ran.stderr
    assert _steps(art) == ["step_000003", "step_000004"]
    assert (art / "checkpoints" / "latest").read_text() == "step_000004"
    before = {p: p.stat().st_mtime_ns for p in (art / "checkpoints").rglob("*")}

    refused = _run(art, "--steps", "2")  # a new run would replace step 2.. and move latest
    _assert_one_line_error(refused, "holds step_000004 from an earlier run", "--resume",
                           "--overwrite")
    assert {p: p.stat().st_mtime_ns for p in (art / "checkpoints").rglob("*")} == before
    assert len(_records(art / "logs" / "train.jsonl")) == 4  # its log untouched too

    resumed = _run(art, "--steps", "1", "--resume", "--no-final-save")
    assert resumed.returncode == 0, resumed.stderr
    assert _steps(art) == ["step_000003", "step_000004"]  # nothing saved at its end
    records = _records(art / "logs" / "train.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]
    assert len({r["run"] for r in records}) == 1  # a resumed run goes on with its log

    fresh = _run(art, "--steps", "2", "--overwrite")
    assert fresh.returncode == 0, fresh.stderr
    records = _records(art / "logs" / "train.jsonl")
    assert [r["step"] for r in records] == [0, 1]
    (earlier,) = (art / "logs" / "runs").iterdir()
    old = _records(earlier / "train.jsonl")
    assert [r["step"] for r in old] == [0, 1, 2, 3, 4] and earlier.name == old[0]["run"]
    assert records[0]["run"] != old[0]["run"]
    assert (art / "checkpoints" / "latest").read_text() == "step_000002"
    assert "step_000004" in _steps(art)  # --keep-last was not asked this time: all stay


def test_keep_last_after_overwrite_keeps_the_new_runs_checkpoints(art) -> None:
    """--keep-last keeps the newest checkpoints by when they were written: a new run's early
    steps outrank an earlier run's later ones."""
    assert _run(art, "--steps", "4", "--checkpoint-every", "1").returncode == 0
    again = _run(art, "--steps", "2", "--checkpoint-every", "1", "--keep-last", "2",
                 "--overwrite")
    assert again.returncode == 0, again.stderr
    assert _steps(art) == ["step_000001", "step_000002"]
    assert (art / "checkpoints" / "latest").read_text() == "step_000002"
