"""The kill test (issue 26): SIGINT or SIGKILL at random moments of ``autopar compile`` (a
re-compile into an artifact that has checkpoints and logs), ``autopar run`` (saving a
checkpoint every step) and ``autopar export --to hf``. After every kill the artifact loads
whole (the old plan or the new one, never a mix), ``latest`` names a complete checkpoint that
``autopar run --resume`` accepts, ``checkpoints/`` and ``logs/`` are there, and the export
folder is absent or complete.

``AUTOPAR_KILL_TRIALS`` sets the number of trials (default 3, one per command, for CI),
``AUTOPAR_KILL_SEED`` the seed of the kill moments, and ``AUTOPAR_KILL_REPORT`` a file for the
tally (JSON).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from functools import partial
from pathlib import Path

import psutil
import pytest

from autopar.artifact.swap import GENERATED, NEW_PREFIX
from autopar.codegen import load_artifact
from autopar.train.checkpoint import latest_checkpoint

from .test_inspect import cli_here

TRIALS = int(os.environ.get("AUTOPAR_KILL_TRIALS", "3"))  # one per command; ~15 s each
SEED = int(os.environ.get("AUTOPAR_KILL_SEED", "26"))
REPO = Path(__file__).resolve().parents[2]
COMMANDS = ("compile", "run", "export")
# two plans of the same model the re-compiles alternate between (the checkpoints fit both)
PLAN_ARGS = {"a": ("--seq", "16"), "b": ("--seq", "32")}
# after the command's own work is seen starting, the signal follows within this many seconds:
# a re-compile's swap and an export's writes take milliseconds, a checkpoint save tens
TARGET_WINDOW_S = {"compile": 0.05, "run": 0.25, "export": 0.05}
ANYTIME_S = 12.0  # "anytime" kills land anywhere in a command's life, imports included


def _compile_args(out: Path, plan: str) -> list[str]:
    return ["compile", "tiny-llama", "--devices", "1", "--cluster", "cpu", "--global-batch",
            "2", *PLAN_ARGS[plan], "--out", str(out), "-q"]


def _generated(directory: Path) -> dict[str, bytes]:
    return {n: (directory / n).read_bytes() for n in GENERATED if (directory / n).is_file()}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> dict:
    """An artifact with checkpoints and logs, and the generated files of both plans."""
    root = tmp_path_factory.mktemp("kill")
    refs = {}
    for plan in PLAN_ARGS:
        made = cli_here(*_compile_args(root / f"ref-{plan}", plan))
        assert made.returncode == 0, made.stderr
        refs[plan] = _generated(root / f"ref-{plan}")
    art = root / "art"
    shutil.copytree(root / "ref-a", art)
    ran = cli_here("run", str(art), "--device", "cpu", "-q", "--steps", "2",
                   "--checkpoint-every", "1")
    assert ran.returncode == 0, ran.stderr
    return {"art": art, "out": root / "hf", "refs": refs}


def _spawn(args: list[str]) -> subprocess.Popen:
    """``python -m autopar ARGS`` from this checkout, in a process group of its own."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}
    return subprocess.Popen([sys.executable, "-m", "autopar", *args], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)


def _work_marks(command: str, art: Path, out: Path) -> set[tuple[str, int]]:
    """(name, inode) of what ``command``'s own work (not its imports) creates: the re-compile's
    new files, a checkpoint being saved, the export's folder being written. A mark not there
    before the command started says its work has begun (an earlier kill's leftovers do not)."""
    if command == "compile":
        found = [e for e in os.scandir(art) if e.name.startswith(NEW_PREFIX)]
    elif command == "run":
        found = [e for e in os.scandir(art / "checkpoints") if e.name.endswith(".partial")]
    else:
        found = [e for e in os.scandir(out.parent) if e.name == out.name + ".partial"]
    marks = set()
    for entry in found:
        with contextlib.suppress(FileNotFoundError):
            marks.add((entry.name, entry.inode()))
    return marks


def _stop(job: subprocess.Popen) -> None:
    """Kill what is left of the job's process group and reap it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(job.pid, signal.SIGKILL)
    job.wait(timeout=30)
    job.stderr.close()


def _leftover_processes(pgid: int) -> list[psutil.Process]:
    out = []
    for proc in psutil.process_iter(["pid"]):
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            if os.getpgid(proc.pid) == pgid:
                out.append(proc)
    return out


def _kill_once(command: str, args: list[str], art: Path, out: Path, rng: random.Random,
               tally: Counter) -> None:
    """Start ``command``, send it SIGINT or SIGKILL at a random moment, wait for it to end."""
    sig = rng.choice((signal.SIGINT, signal.SIGKILL))
    targeted = rng.random() < 0.75
    delay = rng.uniform(0, TARGET_WINDOW_S[command] if targeted else ANYTIME_S)
    before = _work_marks(command, art, out)
    job = _spawn(args)
    try:
        deadline = time.monotonic() + 120
        if targeted:
            while not _work_marks(command, art, out) - before and job.poll() is None:
                assert time.monotonic() < deadline, f"{command} did not start within 120 s"
                time.sleep(0.0005)
        time.sleep(delay)
        if job.poll() is not None:
            tally[f"{command} finished before the signal"] += 1
            assert job.returncode == 0, job.stderr.read().decode()[-2000:]
            return
        os.killpg(job.pid, sig)
        tally[f"{command} {signal.Signals(sig).name} {'at work' if targeted else 'anytime'}"] += 1
        if command == "run" and _work_marks(command, art, out) - before:
            tally["run killed with a checkpoint half-written"] += 1
        try:
            job.wait(timeout=60)  # SIGINT: the command ends on its own
        except subprocess.TimeoutExpired:
            tally[f"{command} ignored SIGINT for 60 s"] += 1
    finally:
        _stop(job)
    assert not _leftover_processes(job.pid), f"{command} left processes behind"


def _check_survivors(art: Path, out: Path, refs: dict, least_step: int, exported: bool) -> int:
    """What must hold after any kill (``exported``: of an export); returns the least step
    ``latest`` may name from now on."""
    load_artifact(art)  # puts back the previous artifact of a cut swap
    files = _generated(art)
    assert files in list(refs.values()), "the artifact mixes two compiles' files"
    assert (art / "logs").is_dir() and (art / "checkpoints").is_dir()
    ckpt = latest_checkpoint(art / "checkpoints")
    assert ckpt is not None, \
        f"latest names no complete checkpoint: {sorted(os.listdir(art / 'checkpoints'))}"
    step = json.loads((ckpt / "meta.json").read_text())["step"]
    assert step >= least_step, f"latest went back from step {least_step} to {step}"
    if exported and not out.exists():  # a killed export's leftovers mislead no later one
        again = cli_here("export", str(art), "--to", "hf", str(out))
        assert again.returncode == 0, again.stderr
    if out.exists():  # whole: transformers loads it, every weight there
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(out))
        assert sum(p.numel() for p in model.parameters()) == 217_664
    resumed = cli_here("run", str(art), "--device", "cpu", "-q", "--steps", "1", "--resume")
    assert resumed.returncode == 0, resumed.stderr
    return step + 1  # the resume saved one more


def test_killed_commands_lose_nothing(workspace) -> None:
    art, out, refs = workspace["art"], workspace["out"], workspace["refs"]
    rng = random.Random(SEED)
    tally: Counter = Counter()
    step = latest_checkpoint(art / "checkpoints")
    least = json.loads((step / "meta.json").read_text())["step"]
    started = time.monotonic()
    for trial in range(TRIALS):
        command = COMMANDS[trial % len(COMMANDS)]
        if command == "compile":
            current = next(k for k, v in refs.items() if v == _generated(art))
            args = _compile_args(art, "b" if current == "a" else "a")
        elif command == "run":
            # a resumed run, or (a third of the time) a new one replacing same-step checkpoints
            again = ("--overwrite",) if rng.random() < 1 / 3 else ("--resume",)
            args = ["run", str(art), "--device", "cpu", "-q", "--steps", "100000",
                    "--checkpoint-every", "1", "--keep-last", "3", *again]
            if again == ("--overwrite",):
                least = 0  # asked for: the new run's step 1 replaces the old one
        else:
            shutil.rmtree(out, ignore_errors=True)  # each export starts without the folder
            args = ["export", str(art), "--to", "hf", str(out)]
        _kill_once(command, args, art, out, rng, tally)
        least = _check_survivors(art, out, refs, least, exported=command == "export")
    report = {"trials": TRIALS, "seed": SEED, "seconds": round(time.monotonic() - started),
              "outcomes": dict(sorted(tally.items()))}
    print(json.dumps(report, indent=2))
    if os.environ.get("AUTOPAR_KILL_REPORT"):
        Path(os.environ["AUTOPAR_KILL_REPORT"]).write_text(json.dumps(report, indent=2) + "\n")
    killed = sum(n for k, n in tally.items() if " SIG" in k)
    assert killed >= TRIALS // 2, f"too few commands were killed: {tally}"


# --- a kill at every step ---------------------------------------------------------------
# Random kill moments rarely land inside the few renames of a swap; these kills do, at each
# file-system change in turn, of the swap and then of the roll-back that undoes it.

_MUTATIONS = ("replace", "rename", "unlink", "rmdir", "mkdir")
CHILD_LIMIT_S = 120


def _killed_after(changes: int, action) -> bool:
    """Run ``action`` in a forked child that SIGKILLs itself before its file-system change
    number ``changes`` (0-based); True when it was killed, False when it finished first."""
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        # a child forked from a threaded process can deadlock on a lock another thread held
        # at the fork: the alarm ends it instead of leaving it behind
        signal.alarm(CHILD_LIMIT_S)
        try:
            count = [0]

            def counted(real):
                def change(*args, **kwargs):
                    if count[0] == changes:
                        os.kill(os.getpid(), signal.SIGKILL)
                    count[0] += 1
                    return real(*args, **kwargs)
                return change

            for name in _MUTATIONS:
                setattr(os, name, counted(getattr(os, name)))
            action()
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGALRM:
        raise AssertionError(f"the forked child ran past {CHILD_LIMIT_S} s (hung)")
    return os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL


def _user_files(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*"))
            if p.is_file() and p.name not in GENERATED}


@pytest.fixture(scope="module")
def two_plans(tmp_path_factory) -> tuple:
    """A tiny model, two plans of it, and the generated files each compiles to."""
    import autopar
    from autopar.models import GPT, GPTConfig, token_inputs

    model = GPT(GPTConfig(n_layers=1, d_model=32, n_heads=2, vocab_size=64, seq_len=16))
    graph = autopar.capture(model, token_inputs(1, 16))
    one = autopar.plan(graph, devices=1, global_batch=2)
    two = autopar.plan(graph, devices=2, global_batch=2, constraints={"dp": 2})
    root = tmp_path_factory.mktemp("refs")
    refs = []
    for i, plan in enumerate((one, two)):
        autopar.compile(model, None, plan, root / str(i))
        refs.append(_generated(root / str(i)))
    return model, one, two, refs


def test_a_recompile_killed_at_any_step_and_its_recovery_killed_at_any_step_lose_nothing(
        two_plans, tmp_path) -> None:
    import autopar
    from autopar.artifact.swap import recover

    model, one, two, refs = two_plans
    tried = 0
    pristine = tmp_path / "pristine"
    autopar.compile(model, None, one, pristine)
    (pristine / "checkpoints" / "step_000001").mkdir(parents=True)
    (pristine / "checkpoints" / "step_000001" / "meta.json").write_text("{}")
    (pristine / "checkpoints" / "latest").write_text("step_000001")
    (pristine / "logs").mkdir()
    (pristine / "logs" / "train.jsonl").write_text('{"step": 0}\n')
    before = _user_files(pristine)
    for swap_step in range(100):
        out = tmp_path / f"art{swap_step}"
        shutil.copytree(pristine, out)
        if not _killed_after(swap_step, partial(autopar.compile, model, None, two, out)):
            break  # the compile made fewer changes than this: every step was cut
        for recover_step in range(100):  # the next reader's recovery, killed in turn
            if not _killed_after(recover_step, partial(recover, out, drop_unfinished=True)):
                break
            tried += 1
        load_artifact(out)
        assert _generated(out) in refs, f"a mixed artifact after a kill at change {swap_step}"
        assert _user_files(out) == before
        if swap_step % 4 == 0:  # and the next compile goes through (the slow part: a sample)
            autopar.compile(model, None, two, out)
            assert _generated(out) == refs[1]
        shutil.rmtree(out)
    assert swap_step > 5 and tried > 0


def test_a_checkpoint_save_killed_at_any_step_keeps_the_one_latest_names(tmp_path) -> None:
    """The hardest save: one of the step ``latest`` names already exists (an --overwrite
    run) and --keep-last prunes; killed before each of its changes, a complete checkpoint of
    that step stays where ``latest`` finds it, and loads."""
    import autopar
    from autopar.codegen.program import generated_program
    from autopar.models import GPT, GPTConfig, token_inputs
    from autopar.models.source import describe_source
    from autopar.train.checkpoint import load_checkpoint, save_checkpoint
    from autopar.train.trainer import Trainer

    model = GPT(GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=1, n_heads=2))
    plan = autopar.plan(autopar.capture(model, token_inputs(1, 16)), devices=1, global_batch=2)
    source = describe_source(model)
    trainer = Trainer(source, plan, program=generated_program(plan, source), device="cpu")
    base = tmp_path / "base"
    for step in (1, 2):
        trainer.step_index = step
        save_checkpoint(trainer, base)
    killed = 0
    for change in range(100):
        root = tmp_path / f"ckpt{change}"
        shutil.copytree(base, root)
        if not _killed_after(change, partial(save_checkpoint, trainer, root, keep_last=1)):
            break
        killed += 1
        ckpt = latest_checkpoint(root)
        assert ckpt is not None, f"latest lost after a kill at change {change}: " \
                                 f"{sorted(os.listdir(root))}"
        assert json.loads((ckpt / "meta.json").read_text())["step"] == 2
        assert load_checkpoint(trainer, root) == 2
        shutil.rmtree(root)
    assert killed > 3


# --- two processes under torchrun ---------------------------------------------------------

DIST_TRIALS = int(os.environ.get("AUTOPAR_KILL_DIST_TRIALS", "0"))  # each takes ~40 s


def _torchrun(art: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            "2", "-m", "autopar", "run", str(art), "--device", "cpu", "-q", *args]


def _job_processes(job: subprocess.Popen) -> list[psutil.Process]:
    """torchrun and its workers (which torchelastic starts in sessions of their own)."""
    with contextlib.suppress(psutil.Error):
        top = psutil.Process(job.pid)
        return [top, *top.children(recursive=True)]
    return []


def _status(proc: psutil.Process) -> str | None:
    """The process's state, or None when it is gone."""
    try:
        return proc.status()
    except psutil.Error:
        return None


@pytest.mark.dist
@pytest.mark.skipif(DIST_TRIALS == 0, reason="set AUTOPAR_KILL_DIST_TRIALS to run it")
def test_a_killed_two_process_run_keeps_its_last_checkpoint(tmp_path) -> None:
    """SIGINT to torchrun (what Ctrl-C sends) or SIGKILL to every process of the job, while
    both ranks save a checkpoint every step: the last complete one resumes under torchrun."""
    art = tmp_path / "art"
    made = cli_here("compile", "tiny-llama", "--devices", "2", "--cluster", "cpu", "--seq", "16",
                    "--global-batch", "2", "--constraints", "dp=2", "--out", str(art), "-q")
    assert made.returncode == 0, made.stderr
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}
    first = subprocess.run(_torchrun(art, "--steps", "1"), env=env, capture_output=True,
                           text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    rng = random.Random(SEED)
    least = 1
    for _ in range(DIST_TRIALS):
        sig = rng.choice((signal.SIGINT, signal.SIGKILL))
        before = _work_marks("run", art, art)
        job = subprocess.Popen(_torchrun(art, "--steps", "100000", "--checkpoint-every", "1",
                                         "--resume"), env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, start_new_session=True)
        seen: dict[int, psutil.Process] = {}
        try:
            deadline = time.monotonic() + 240
            while not _work_marks("run", art, art) - before:
                assert job.poll() is None and time.monotonic() < deadline, "no save began"
                time.sleep(0.001)
            time.sleep(rng.uniform(0, TARGET_WINDOW_S["run"]))
            seen.update((p.pid, p) for p in _job_processes(job))
            targets = [seen[job.pid]] if sig == signal.SIGINT else list(seen.values())
            for proc in targets:
                with contextlib.suppress(psutil.Error):
                    proc.send_signal(sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                job.wait(timeout=90)
        finally:
            seen.update((p.pid, p) for p in _job_processes(job))
            for proc in seen.values():
                with contextlib.suppress(psutil.Error):
                    proc.kill()
            job.wait(timeout=30)
        # a killed worker outlives torchrun until its new parent reaps it
        _, alive = psutil.wait_procs(list(seen.values()), timeout=30)
        running = [p for p in alive if _status(p) not in (psutil.STATUS_ZOMBIE, None)]
        assert not running, f"the job left processes behind: {running}"
        ckpt = latest_checkpoint(art / "checkpoints")
        assert ckpt is not None and (art / "logs").is_dir()
        step = json.loads((ckpt / "meta.json").read_text())["step"]
        assert step >= least
        resumed = subprocess.run(_torchrun(art, "--steps", "1", "--resume"), env=env,
                                 capture_output=True, text=True, timeout=300)
        assert resumed.returncode == 0, resumed.stderr[-2000:]
        least = step + 1
