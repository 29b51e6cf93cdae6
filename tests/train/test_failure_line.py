"""The line a failed rank ends with: the cause, where the whole error is kept, and advice that
fits the error (an out-of-memory error is not fixed by --resume)."""

from __future__ import annotations

import types

import torch

import autopar
from autopar.train.launch import failure_line


def _plan():
    return autopar.plan("tiny-llama", seq=16, devices=2, global_batch=2, cluster="cpu",
                        constraints={"dp": 2})


def test_out_of_memory_gets_a_leaner_plan_not_resume(tmp_path) -> None:
    plan = _plan()
    trainer = types.SimpleNamespace(rank=1, step_index=7)
    try:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB " + "x" * 400)
    except torch.OutOfMemoryError as exc:
        line = failure_line(exc, trainer, plan, tmp_path / "logs", tmp_path / "checkpoints")
    assert "\n" not in line and len(line) < 900
    assert line.startswith("rank 1 ran out of memory at step 7")
    assert "re-plan leaner" in line and "--resume" not in line
    kept = tmp_path / "logs" / "error-rank1.txt"
    assert f"whole error in {kept}" in line
    assert "x" * 400 in kept.read_text() and "Traceback" in kept.read_text()


def test_a_lost_peer_names_the_last_checkpoint_and_resume(tmp_path) -> None:
    plan = _plan()
    trainer = types.SimpleNamespace(rank=0, step_index=3)
    try:
        raise ConnectionError("Connection closed by peer [127.0.0.1]:29500")
    except ConnectionError as exc:
        line = failure_line(exc, trainer, plan, tmp_path / "logs", tmp_path / "checkpoints")
    assert line.startswith("rank 0 lost its peers at step 3 (a process died or the network")
    assert line.endswith("last complete checkpoint: none; relaunch with --resume")
