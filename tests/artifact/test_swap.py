"""Re-compiling into an artifact replaces its generated files and nothing else: checkpoints,
logs and the user's files stay put, an edited program is kept, and a compile cut short at any
point leaves the previous artifact, which loads."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

import autopar
from autopar.artifact import load_artifact
from autopar.artifact import swap as artifact_swap
from autopar.models import GPT, GPTConfig, token_inputs


@pytest.fixture(scope="module")
def plans() -> tuple:
    model = GPT(GPTConfig(n_layers=1, d_model=32, n_heads=2, vocab_size=64, seq_len=16))
    graph = autopar.capture(model, token_inputs(1, 16))
    one = autopar.plan(graph, devices=1, global_batch=2)
    two = autopar.plan(graph, devices=2, global_batch=2, constraints={"dp": 2})
    return model, one, two


def _artifact_with_a_run(model, plan, out: Path) -> Path:
    autopar.compile(model, None, plan, out)
    (out / "checkpoints" / "step_1").mkdir(parents=True)
    (out / "checkpoints" / "step_1" / "weights.bin").write_bytes(b"\x01" * 64)
    (out / "checkpoints" / "latest").write_text("step_1")
    (out / "logs").mkdir()
    (out / "logs" / "train.jsonl").write_text('{"step": 0}\n')
    (out / "notes.txt").write_text("mine")
    return out


def _user_files(out: Path) -> dict:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*"))
            if p.is_file() and p.name not in artifact_swap.GENERATED}


def test_recompiling_swaps_the_generated_files_and_keeps_everything_else(plans, tmp_path):
    model, one, two = plans
    out = _artifact_with_a_run(model, one, tmp_path / "art")
    before = _user_files(out)
    autopar.compile(model, None, two, out)
    assert load_artifact(out)[1].devices == 2
    assert _user_files(out) == before
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # nothing half-done left
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_each_edit_of_the_program_is_kept_across_recompiles(plans, tmp_path):
    model, one, two = plans
    out = _artifact_with_a_run(model, one, tmp_path / "art")
    (out / "train.py").write_text((out / "train.py").read_text() + "# first edit\n")
    autopar.compile(model, None, two, out)
    (out / "train.py").write_text((out / "train.py").read_text() + "# second edit\n")
    autopar.compile(model, None, one, out)
    assert (out / "train.edited.py").read_text().endswith("# first edit\n")
    assert (out / "train.edited.2.py").read_text().endswith("# second edit\n")
    assert "# second edit" not in (out / "train.py").read_text()


def _replace_failing_after(count: int, error: type[BaseException]):
    """os.replace that raises ``error`` instead of its rename number ``count`` (0-based)."""
    real, calls = os.replace, []

    def replace(src, dst):
        if len(calls) == count:
            raise error
        calls.append(dst)
        real(src, dst)

    return replace


@pytest.mark.parametrize("renames_before_failure", range(7))
def test_a_compile_cut_short_leaves_the_previous_artifact(plans, tmp_path, monkeypatch,
                                                          renames_before_failure):
    """A failure (or Ctrl-C) after any number of the swap's renames rolls back at once."""
    model, one, two = plans
    out = _artifact_with_a_run(model, one, tmp_path / "art")
    before = _user_files(out)
    monkeypatch.setattr(artifact_swap.os, "replace",
                        _replace_failing_after(renames_before_failure, KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        autopar.compile(model, None, two, out)
    monkeypatch.undo()
    assert load_artifact(out)[1].devices == 1
    assert _user_files(out) == before
    assert not [p for p in out.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("renames_before_kill", [1, 2, 3, 5, 6])
def test_a_compile_killed_mid_swap_is_undone_by_the_next_load(plans, tmp_path, monkeypatch,
                                                              renames_before_kill):
    """SIGKILL runs no handler: the half-swapped directory is put back by whoever reads it
    next (every rank's load_artifact, under a lock)."""
    model, one, two = plans
    out = _artifact_with_a_run(model, one, tmp_path / "art")
    before = _user_files(out)

    class Killed(BaseException):
        pass

    monkeypatch.setattr(artifact_swap.os, "replace",
                        _replace_failing_after(renames_before_kill, Killed))
    monkeypatch.setattr(artifact_swap, "_roll_back", lambda directory: None)  # no handler ran
    with pytest.raises(Killed):
        autopar.compile(model, None, two, out)
    monkeypatch.undo()
    assert load_artifact(out)[1].devices == 1
    assert _user_files(out) == before
    autopar.compile(model, None, two, out)  # and the next compile goes through
    assert load_artifact(out)[1].devices == 2


def test_an_interrupt_during_the_swap_waits_for_its_end() -> None:
    done = []
    with pytest.raises(KeyboardInterrupt):
        with artifact_swap._signals_deferred():
            os.kill(os.getpid(), signal.SIGINT)
            done.append("the block finished")
    assert done == ["the block finished"]


def test_out_that_is_not_an_artifact_is_refused_and_left_alone(plans, tmp_path, monkeypatch):
    model, one, _ = plans
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "manifest.json").write_text('{"name": "some other tool"}')  # not ours
    with pytest.raises(autopar.PlanError, match="not an autopar artifact"):
        autopar.compile(model, None, one, foreign)
    assert [p.name for p in foreign.iterdir()] == ["manifest.json"]
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(autopar.PlanError, match="is a file"):
        autopar.compile(model, None, one, a_file)
    here = tmp_path / "work" / "sub"
    here.mkdir(parents=True)
    monkeypatch.chdir(here)
    for target in (".", ".."):
        with pytest.raises(autopar.PlanError, match="current directory or one of its parents"):
            autopar.compile(model, None, one, target)
    assert not any(here.iterdir())
