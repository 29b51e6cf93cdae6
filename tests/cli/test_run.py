"""``autopar compile`` then ``torchrun -m autopar run`` as a user runs them."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from .test_inspect import _assert_one_line_error, cli_here, run_cli

pytestmark = pytest.mark.dist


def _torchrun(nproc: int, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", str(nproc), "-m", "autopar", *args],
                          capture_output=True, text=True, timeout=180)


def test_compile_then_run_under_torchrun(tmp_path) -> None:
    art = tmp_path / "art"
    made = cli_here("compile", "tiny-llama", "--devices", "2", "--seq", "32", "--global-batch",
                    "4", "--constraints", "dp=2,pp=1,zero_stage=3", "--out", str(art), "-q")
    assert made.returncode == 0, made.stderr
    assert {p.name for p in art.iterdir()} == {"plan.yaml", "manifest.json", "train.py"}
    assert "fully_shard(" in (art / "train.py").read_text()
    result = _torchrun(2, "run", str(art), "--steps", "3", "--device", "cpu")
    assert result.returncode == 0, result.stderr[-2000:]
    records = [json.loads(line) for line in (art / "logs" / "train.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
    assert all(r["loss"] > 0 and r["tokens_per_s"] > 0 and r["peak_memory_bytes"] > 0
               for r in records)


def test_run_refuses_a_world_size_that_is_not_the_plans(tmp_path) -> None:
    art = tmp_path / "art"
    assert cli_here("compile", "tiny-llama", "--devices", "2", "--seq", "32", "--constraints",
                    "dp=2,pp=1", "--out", str(art), "-q").returncode == 0
    _assert_one_line_error(cli_here("run", str(art), "--steps", "1", "--device", "cpu"),
                           "torchrun --nproc-per-node 2")
    assert not (art / "logs").exists()  # nothing started


def test_run_bad_artifacts(tmp_path) -> None:
    _assert_one_line_error(cli_here("run", str(tmp_path)), "not an autopar artifact")
    (tmp_path / "manifest.json").write_text("{broken")
    _assert_one_line_error(cli_here("run", str(tmp_path)), "corrupt")
    (tmp_path / "manifest.json").write_text(json.dumps({"manifest_version": 99}))
    _assert_one_line_error(cli_here("run", str(tmp_path)), "manifest version")


FIXTURES = str(Path(__file__).resolve().parent.parent / "fixtures")


def _compile_and_train(tmp_path, devices: int, constraints: str) -> list[float]:
    art = tmp_path / constraints.replace(",", "_").replace("=", "")
    # fp32: compared with one process to 1e-4
    pins = ",".join(filter(None, (constraints, "precision=fp32")))
    args = ["compile", "plain_lm:make", "--devices", str(devices), "--global-batch", "4",
            "--out", str(art), "-q", "--constraints", pins]
    made = cli_here(*args, cwd=FIXTURES)  # the command line in-process; the run is torchrun
    assert made.returncode == 0, made.stderr
    cmd = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            str(devices), "-m", "autopar"] if devices > 1 else [sys.executable, "-m", "autopar"])
    result = subprocess.run([*cmd, "run", str(art), "--steps", "3", "--device", "cpu"],
                            capture_output=True, text=True, timeout=180, cwd=FIXTURES)
    assert result.returncode == 0, result.stderr[-2000:]
    log = (art / "logs" / "train.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in log]


def test_a_plain_module_factory_trains_under_every_mode(tmp_path) -> None:
    """A ``module:factory`` returning a plain nn.Module (no config, no vocab_size): its output
    size comes from the captured graph, and dp2, tp2, pp2 and ZeRO-3 train like one process."""
    single = _compile_and_train(tmp_path, 1, "")
    for constraints in ("dp=2,pp=1,zero_stage=0", "tp=2,pp=1", "pp=2",
                        "dp=2,pp=1,zero_stage=3"):
        assert _compile_and_train(tmp_path, 2, constraints) == pytest.approx(single, abs=1e-4)


@pytest.mark.parametrize("constraints", ["", "offload=optimizer+params"])
def test_one_device_plans_run_under_torchrun_and_as_one_process(tmp_path, constraints) -> None:
    """The 1-device plan the search picks on a CPU cluster (and one pinned to offload) trains
    under ``torchrun --nproc-per-node 1`` exactly as in a plain process."""
    art = tmp_path / "art"
    args = ["compile", "tiny-llama", "--devices", "1", "--seq", "32", "--global-batch", "2",
            "--cluster", "cpu", "--out", str(art), "-q"]
    made = run_cli(*args, *(["--constraints", constraints] if constraints else []))
    assert made.returncode == 0, made.stderr
    plan = yaml.safe_load((art / "plan.yaml").read_text())
    assert plan["offload"] == (constraints.split("=")[1].split("+") if constraints else [])
    losses = []
    for launcher in (_torchrun, lambda n, *a: run_cli(*a)):
        (art / "logs").exists() and shutil.rmtree(art / "logs")
        result = launcher(1, "run", str(art), "--steps", "2", "--device", "cpu", "--overwrite")
        assert result.returncode == 0, result.stderr[-2000:]
        log = (art / "logs" / "train.jsonl").read_text().splitlines()
        losses.append([json.loads(line)["loss"] for line in log])
    assert losses[0] == pytest.approx(losses[1], abs=1e-6)


def test_two_torchrun_agents_train_as_one_job(tmp_path) -> None:
    """Two torchrun agents (``--nnodes 2``, c10d rendezvous on this machine, one process each)
    run a dp2 ZeRO-3 plan as one job, with one process's losses."""
    from autopar.calibrate.profile_comm import free_port

    art = tmp_path / "art"
    made = cli_here("compile", "tiny-llama", "--devices", "2", "--seq", "32", "--global-batch",
                    "4", "--constraints", "dp=2,pp=1,zero_stage=3,precision=fp32", "--out",
                    str(art), "-q")
    assert made.returncode == 0, made.stderr
    port = free_port()
    agents = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(r),
         "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
         f"127.0.0.1:{port}", "--rdzv-id", "two-nodes", "-m", "autopar", "run", str(art),
         "--steps", "3", "--device", "cpu"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    try:
        results = [a.communicate(timeout=240) for a in agents]
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()
                a.wait(timeout=10)
    assert all(a.returncode == 0 for a in agents), results[0][1][-2000:] + results[1][1][-2000:]
    losses = [json.loads(line)["loss"] for line in
              (art / "logs" / "train.jsonl").read_text().splitlines()]

    single = tmp_path / "single"
    assert cli_here("compile", "tiny-llama", "--devices", "1", "--seq", "32", "--global-batch",
                    "4", "--constraints", "precision=fp32", "--out", str(single),
                    "-q").returncode == 0
    assert run_cli("run", str(single), "--steps", "3", "--device", "cpu").returncode == 0
    reference = [json.loads(line)["loss"] for line in
                 (single / "logs" / "train.jsonl").read_text().splitlines()]
    assert losses == pytest.approx(reference, rel=1e-4)


ROOT = str(Path(__file__).resolve().parents[2])


def test_a_vit_compiles_and_trains_under_torchrun_as_a_classifier(tmp_path) -> None:
    """A new user's ViT (a plain nn.Module factory: images in, classes out): ``autopar
    compile`` then ``torchrun DIR/train.py`` trains it as a classifier, logged in samples/s;
    token data (--data FILE, --eval) is refused in one line."""
    import os

    art = tmp_path / "vit"
    made = cli_here("compile", "tests.fixtures.plain_models:make_vit", "--devices", "2",
                    "--global-batch", "4", "--constraints", "tp=2,precision=fp32", "--out",
                    str(art), "-q")
    assert made.returncode == 0, made.stderr
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(art / "train.py"), "--steps", "3", "--device", "cpu"],
        capture_output=True, text=True, timeout=180, cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=ROOT))  # the factory's module, as the user's own
    assert result.returncode == 0, result.stderr[-2000:]
    assert "samples/s" in result.stdout and "tok/s" not in result.stdout
    records = [json.loads(line) for line in (art / "logs" / "train.jsonl").read_text()
               .splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
    assert all(r["samples_per_s"] > 0 and "tokens_per_s" not in r for r in records)
    report = cli_here("report", str(art), "--run")  # the run beside its plan, in samples
    assert report.returncode == 0, report.stderr
    assert "samples/s" in report.stdout and "tokens/s" not in report.stdout

    one = tmp_path / "vit1"
    assert cli_here("compile", "tests.fixtures.plain_models:make_vit", "--devices", "1",
                    "--global-batch", "4", "--out", str(one), "-q").returncode == 0
    _assert_one_line_error(cli_here("run", str(one), "--steps", "1", "--device", "cpu",
                                    "--data", str(tmp_path / "corpus")), "classifier",
                           "drop --data")
    _assert_one_line_error(cli_here("run", str(one), "--steps", "1", "--device", "cpu",
                                    "--eval", "synthetic"), "classifier", "drop --eval")
