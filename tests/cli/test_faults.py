"""Kill one rank mid-run: the job ends promptly with a clear message, checkpoints intact."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import psutil
import pytest

from .test_inspect import cli_here

pytestmark = pytest.mark.dist


def test_killed_rank_ends_the_job_and_keeps_the_last_checkpoint(tmp_path) -> None:
    art = tmp_path / "art"
    made = cli_here("compile", "tiny-llama", "--devices", "2", "--seq", "32", "--global-batch",
                    "4", "--constraints", "dp=2,pp=1,zero_stage=3", "--out", str(art), "-q")
    assert made.returncode == 0, made.stderr
    job = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "autopar", "run", str(art), "--steps", "100000", "--checkpoint-every", "2",
         "--device", "cpu"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        latest = art / "checkpoints" / "latest"
        while not latest.exists():
            assert job.poll() is None, job.stderr.read()[-2000:]
            assert time.monotonic() < deadline, "no checkpoint within 120 s"
            time.sleep(0.5)
        workers = [p for p in psutil.Process(job.pid).children(recursive=True)
                   if "autopar" in " ".join(p.cmdline()) and "distributed.run" not in
                   " ".join(p.cmdline())]
        assert len(workers) == 2
        killed_at = time.monotonic()
        workers[1].send_signal(signal.SIGKILL)
        _, stderr = job.communicate(timeout=90)
        elapsed = time.monotonic() - killed_at
    finally:
        if job.poll() is None:
            for p in psutil.Process(job.pid).children(recursive=True):
                p.kill()
            job.kill()
            job.wait(timeout=10)
    assert job.returncode != 0
    assert elapsed < 90
    assert "exitcode" in stderr or "lost its peers" in stderr  # torchrun / autopar say why
    name = latest.read_text().strip()
    meta = json.loads((art / "checkpoints" / name / "meta.json").read_text())
    assert meta["step"] >= 2 and meta["step"] % 2 == 0
    # the surviving checkpoint resumes
    resumed = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "autopar", "run", str(art), "--steps", "1", "--resume", "--device", "cpu"],
        capture_output=True, text=True, timeout=120)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "loss" in resumed.stdout
