"""Shared fixtures: tiny models every test package uses; how the suite shares the machine."""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
import time
import uuid
import warnings
from pathlib import Path

import pytest
import torch

from autopar.models import GPT, GPTConfig
from tests.fixtures.gpt_fixture import gpt  # noqa: F401 - the fixture, shared by every test package

TINY_HF = ["tiny-llama", "tiny-mistral", "tiny-mixtral", "tiny-qwen2", "tiny-gpt2"]
TRAINED_STEPS = 4  # of the trained_pp2 artifact


# The suite runs on pytest-xdist workers (pyproject's addopts: ``-n auto --dist loadgroup``):
# most tests are single-threaded Python (capture, search), so on 2 cores one worker leaves a
# core idle. A file's tests share a worker (see SPREAD_FILES), so module fixtures run once.
def pytest_xdist_auto_num_workers(config) -> int:
    """One worker per core (xdist's own count is physical cores), at most 4: the gloo tests
    run 2-4 processes each."""
    return max(1, min(len(os.sched_getaffinity(0)), 4))


# files whose tests share nothing expensive (no module fixture) and take minutes together:
# their tests are spread over the workers one by one; every other file keeps its tests on one
# worker (pyproject's ``--dist loadgroup``, one group per file), so module fixtures run once
SPREAD_FILES = frozenset({
    "tests/models/test_shipped_configs.py",
    "tests/parallel/test_twins.py",
    "tests/parallel/test_random_plans.py",
    "tests/test_examples.py",
    "tests/peft/test_runtime.py",
    "tests/cli/test_run.py",
})


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items) -> None:
    """Group each test with its file's (xdist_group), except the files of SPREAD_FILES."""
    root = Path(str(config.rootpath))
    for item in items:
        path = Path(str(item.path)).relative_to(root).as_posix()
        if path not in SPREAD_FILES and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(path))


def _lock_path(testrunuid: str, kind: str = "run") -> Path:
    return Path(tempfile.gettempdir()) / f"autopar-tests-{testrunuid}.{kind}.lock"


def _graph_cache(uid: str) -> Path:
    return Path(tempfile.gettempdir()) / f"autopar-tests-{uid}.graphs"


def pytest_configure(config) -> None:
    # the controller names the run (xdist hands the name to its workers) so that it can
    # remove the run's lock files when the run ends
    if not hasattr(config, "workerinput") and getattr(config.option, "testrunuid", "") is None:
        config.option.testrunuid = uuid.uuid4().hex
    # one graph cache (autopar.capture.cache) for the run's workers and the programs they
    # start: a config is captured once per run, and never read from a user's cache
    uid = getattr(config.option, "testrunuid", None) or os.environ.get(
        "PYTEST_XDIST_TESTRUNUID") or uuid.uuid4().hex
    config._autopar_graphs = str(_graph_cache(uid))
    os.environ["AUTOPAR_CACHE_DIR"] = config._autopar_graphs
    os.environ.pop("AUTOPAR_CACHE", None)


def pytest_unconfigure(config) -> None:
    uid = getattr(config.option, "testrunuid", None)
    if uid and not hasattr(config, "workerinput"):
        for kind in ("run", "gate"):
            _lock_path(uid, kind).unlink(missing_ok=True)
    if not hasattr(config, "workerinput"):
        shutil.rmtree(getattr(config, "_autopar_graphs", ""), ignore_errors=True)


EXCLUSIVE_WAIT_S = 900  # then the exclusive test runs beside the others rather than hang


def _take_exclusive(run, gate) -> bool:
    """Take the run lock exclusively: hold the gate (new tests wait at it, so a stream of
    short tests cannot starve this one), then poll until the running tests finish. False if
    they did not within EXCLUSIVE_WAIT_S."""
    fcntl.lockf(gate, fcntl.LOCK_EX)
    try:
        deadline = time.monotonic() + EXCLUSIVE_WAIT_S
        while True:
            try:
                fcntl.lockf(run, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except OSError:
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.2)
    finally:
        fcntl.lockf(gate, fcntl.LOCK_UN)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Tests marked ``exclusive`` time the machine itself (``autopar profile``'s sweeps): they
    run, fixtures included, while no other worker runs a test. Every other test holds the
    run lock shared; without xdist there is nothing to share. POSIX record locks (lockf)
    belong to the process, so a child a test forks never holds them."""
    uid = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if uid is None:
        return (yield)
    with open(_lock_path(uid), "a+") as run, open(_lock_path(uid, "gate"), "a+") as gate:
        if item.get_closest_marker("exclusive") is not None:
            if not _take_exclusive(run, gate):
                warnings.warn(f"{item.nodeid} ran beside other tests: they held the machine "
                              f"for {EXCLUSIVE_WAIT_S} s", stacklevel=1)
        else:
            fcntl.lockf(gate, fcntl.LOCK_SH)  # waits while an exclusive test is queued
            fcntl.lockf(run, fcntl.LOCK_SH)
            fcntl.lockf(gate, fcntl.LOCK_UN)
        try:
            return (yield)
        finally:
            fcntl.lockf(run, fcntl.LOCK_UN)


@pytest.fixture
def tiny_gpt_config() -> GPTConfig:
    return GPTConfig(vocab_size=256, seq_len=32, d_model=64, n_layers=2, n_heads=4)


@pytest.fixture
def tiny_gpt(tiny_gpt_config: GPTConfig) -> GPT:
    torch.manual_seed(0)
    return GPT(tiny_gpt_config)


@pytest.fixture
def token_ids(tiny_gpt_config: GPTConfig) -> torch.Tensor:
    return torch.randint(0, tiny_gpt_config.vocab_size, (2, tiny_gpt_config.seq_len))


@pytest.fixture(scope="session")
def hf_folder(tmp_path_factory):
    """``hf_folder(name)``: a shipped tiny config saved with ``save_pretrained`` (random fp32
    weights from seed 0) in a session temp folder, once per name; returns the folder."""
    from autopar.models.hf import build_model

    saved: dict[str, object] = {}

    def make(name: str):
        if name not in saved:
            torch.manual_seed(0)
            model = build_model(name, device="cpu", dtype=torch.float32)
            folder = tmp_path_factory.mktemp(f"hf-{name}")
            model.save_pretrained(folder)
            saved[name] = folder
        return saved[name]

    return make


@pytest.fixture(scope="session")
def trained_pp2(tmp_path_factory):
    """A pp2 artifact of tiny Llama on the CPU catalog, trained under torchrun on 2 gloo
    processes for TRAINED_STEPS steps with a cosine schedule, evaluated every 2 steps and
    profiled (steps 1..3), its output captured as a log file would be (not a terminal):
    (artifact dir, the torchrun CompletedProcess). Trained once per session, read by the
    training-loop tests and the report's; do not write into it."""
    from tests.cli.test_inspect import cli_here
    from tests.cli.test_run import _torchrun

    art = tmp_path_factory.mktemp("loop") / "art"
    made = cli_here("compile", "tiny-llama", "--devices", "2", "--seq", "32", "--global-batch",
                    "4", "--cluster", "cpu", "--constraints", "pp=2,dp=1,microbatch_size=1",
                    "--out", str(art), "-q")
    assert made.returncode == 0, made.stderr
    ran = _torchrun(2, "run", str(art), "--steps", str(TRAINED_STEPS), "--device", "cpu",
                    "--lr", "2e-3", "--warmup-steps", "1", "--lr-schedule", "cosine",
                    "--min-lr", "2e-4", "--eval", "synthetic", "--eval-every", "2", "--profile")
    assert ran.returncode == 0, ran.stderr[-3000:]
    return art, ran
