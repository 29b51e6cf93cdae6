"""The launcher of a training run: one rank of a torchrun job (or one process) from an
artifact directory to its last line. It loads the program to run (:func:`run_program`),
picks the device, joins the job's process group (:func:`init_process_group`), runs the
Trainer, turns a failing rank's error into one line (:func:`failure_line`) and tears the
groups down in order (:func:`teardown`). ``autopar run`` calls :func:`train_artifact` once its
options are read."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import sys
import traceback
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import NoReturn

import click
import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

from autopar.artifact import digest, load_artifact, load_program, program_state
from autopar.calibrate.profiling import StepProfiler, summary_text
from autopar.codegen import program_file, regenerate_program
from autopar.cost.hardware import load_cluster
from autopar.errors import AutoparError, PlanError, RunFailure
from autopar.plan.support import refuse_unsupported
from autopar.report import fmt
from autopar.train.checkpoint import latest_checkpoint
from autopar.train.evaluate import HeldOut, evaluate, held_out_source
from autopar.train.options import RunOptions
from autopar.train.run_flags import BACKENDS, hyperparameters, profile_window
from autopar.train.run_log import RunLog, archive_logs
from autopar.train.trainer import Trainer

_joined_group = False  # this process joined a torchrun job's process group


def init_process_group(backend: str, timeout_s: int = 600) -> None:
    """Join the job's process group (torchrun's environment; a collective fails after
    ``timeout_s`` seconds without its peers) and remember that this process did: it then ends
    through :func:`autopar.cli.end_process` without interpreter finalization."""
    global _joined_group
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    _joined_group = True


def joined_process_group() -> bool:
    """Whether this process joined a process group (:func:`init_process_group`)."""
    return _joined_group




def device_type(cluster: str, override: str | None) -> str:
    if override:
        return override

    try:
        return load_cluster(cluster).device.type
    except PlanError:  # a profile file from another machine: run where we are
        return "cpu"


def run_program(directory: str, manifest: dict, plan, needs: tuple[str, ...] = ()) -> object:
    """The program to run, as a module: DIR/train.py (DIR/generate.py for a plan of task
    "infer") as autopar wrote it, regenerated when plan.yaml changed since (one process per
    machine writes it), or as the user edited it (kept, and said so); refused in one line when
    it lacks a function of ``needs``."""
    name = program_file(plan)
    path = Path(directory) / name
    state = program_state(directory, name)
    speak = int(os.environ.get("RANK", "0")) == 0
    note = None
    if state in ("missing", "stale"):
        writer = int(os.environ.get("LOCAL_RANK", "0")) == 0
        text = regenerate_program(directory, plan, manifest, write=writer)
        note = (f"{name} was missing" if state == "missing" else
                f"plan.yaml changed since {name} was generated") + ": regenerated it"
    else:
        text = path.read_text()
        if state == "edited":
            note = (f"{path} was edited by hand: running it as it is (delete it to "
                    f"regenerate it from plan.yaml)")
            if digest((Path(directory) / "plan.yaml").read_bytes()) != \
                    manifest.get("program", {}).get("plan_sha256"):
                note += "; plan.yaml changed too, and your program may not follow it"
    try:
        program = load_program(text, str(path))
    except SyntaxError as exc:
        raise PlanError(f"{path}:{exc.lineno}: {exc.msg}; fix it, or delete it to regenerate "
                        f"it from plan.yaml") from None
    except Exception as exc:  # noqa: BLE001 - a hand-edited program's own error, in one line
        raise PlanError(f"{path} fails to load ({type(exc).__name__}: {exc}); fix it, or "
                        f"delete it to regenerate it from plan.yaml") from None
    missing = [f for f in needs if not callable(getattr(program, f, None))]
    if missing:
        raise PlanError(f"{path} defines no {missing[0]}(), which autopar run calls; restore "
                        f"it, or delete the file to regenerate it from plan.yaml")
    if note and speak:
        click.echo(f"autopar: {note}", err=True)
    return program


def train_artifact(options: RunOptions, manifest: dict | None = None, plan=None, *,
                   hyper=None, held=None, window: tuple[int, int] | None = None) -> None:
    """Train the artifact in ``options.directory`` (its ``manifest`` and ``plan``, loaded and
    checked) as one rank of a torchrun job, or as one process: its program (regenerated, or
    kept as edited), the device, the job's process group, the Trainer's run and its last line,
    then the groups torn down in order. ``hyper``: the Hyperparameters; ``held``: the held-out
    data (or None); ``window``: the profiled steps (or None). A lost peer or a failing step
    ends in one :class:`RunFailure` line (:func:`failure_line`). What ``autopar run`` calls
    once its options are read; a generated train.py run as a script calls it with
    ``options`` alone, and the artifact and the run's settings are read here as autopar run
    reads them."""
    if manifest is None or plan is None:
        manifest, plan = load_artifact(options.directory)
        refuse_unsupported(plan)
        hyper, held, window = run_settings(options)
    directory, resume, training = options.directory, options.resume, options.training
    program = run_program(directory, manifest, plan)
    if resume and options.init_from and int(os.environ.get("RANK", "0")) == 0:
        click.echo("autopar: --resume continues from DIR/checkpoints; --init-from is not read",
                   err=True)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    plan.check_world_size(world)
    _refuse_unasked_overwrite(directory, resume, bool(training["overwrite"]))
    if not resume and int(os.environ.get("RANK", "0")) == 0:
        # one log per run: an earlier run's go to logs/runs/<its id> (before any rank can
        # start writing: the others wait for rank 0 in the process group's start)
        archive_logs(Path(directory) / "logs")
    kind = join_job(plan.cluster, options.device, world, options.timeout_s)
    finished = False
    try:
        _train(options, manifest, plan, program, kind, world, hyper, held, window)
        finished = True
    finally:
        # _train has returned: its trainer and model are unreferenced, so teardown's
        # collection frees them (and a DDP reducer's hold on a group) before the groups go
        teardown(world, finished)


def join_job(cluster: str, device: str | None, world: int, timeout_s: int) -> str:
    """Take this process's accelerator (before any collective needs it) and join the job's
    process group when there are peers; returns the device type the run uses."""
    kind = device_type(cluster, device)
    if kind != "cpu":
        if not torch.accelerator.is_available():
            raise PlanError(f"the plan is for {cluster} ({kind}) but this machine has no "
                            f"accelerator; add --device cpu to run it on CPU processes")
        torch.accelerator.set_device_index(int(os.environ.get("LOCAL_RANK", "0")))
    if world > 1:
        init_process_group(BACKENDS[kind], timeout_s)
    return kind


def run_settings(options: RunOptions) -> tuple:
    """(hyperparameters, held-out data or None, profiled steps or None) of a training run
    from its options, each checked before any process group starts."""
    training = options.training
    hyper = hyperparameters(training)
    if not options.resume:
        hyper.with_horizon(options.steps)  # a warm-up longer than the run is refused here
    window = profile_window(options.steps, training["profile_steps"]) if training["profile"] \
        else None
    held = None
    if training["eval_source"] is not None:
        held = HeldOut(str(training["eval_source"]), int(training["eval_batches"]))
    elif training["eval_every"]:
        raise PlanError("--eval-every needs --eval PATH|synthetic: the held-out data")
    return hyper, held, window


@contextlib.contextmanager
def one_line_errors() -> Iterator[None]:
    """Run a generated program's ``__main__`` as ``autopar run`` runs: a bad option or input
    ends in one line on stderr and exit code 2, and the process ends as the CLI's does
    (:func:`autopar.cli.end_process`: a rank that joined a process group leaves without
    interpreter finalization)."""
    code = 0
    try:
        yield
    except click.UsageError as exc:
        print(fail_message(exc.format_message(), exc.ctx), file=sys.stderr)
        code = 2
    except click.exceptions.Exit as exc:  # --help
        code = exc.exit_code
    except AutoparError as exc:
        print(fail_message(str(exc), None), file=sys.stderr)
        code = getattr(exc, "exit_code", 2)
    end_process(code)


def _train(options: RunOptions, manifest: dict, plan, program, kind: str, world: int, hyper,
           held, window: tuple[int, int] | None) -> None:
    """The run between process-group start and teardown: build the trainer, train, report
    on rank 0. A lost peer or a failing step becomes one RunFailure line."""
    directory, steps, resume, training = options.directory, options.steps, options.resume, \
        options.training
    logs = Path(directory) / "logs"
    rank = int(os.environ.get("RANK", "0"))
    run_log = RunLog(logs, console=not training["quiet"], tensorboard=True,
                     every=int(training["log_every"]), resume=resume) if rank == 0 else None
    trainer = Trainer(manifest["model"], plan, program=program, device=kind, seed=options.seed,
                      hyper=hyper, log=run_log, data=options.data,
                      init_from=None if resume else options.init_from,
                      document_mask=bool(training.get("document_mask", True)))
    if rank == 0 and options.data != "synthetic" and not trainer.task.classifies:
        click.echo(f"autopar: {trainer.document_choice}", err=True)
    evaluate = _evaluator(held, trainer)  # held-out data checked before any step
    profiler = StepProfiler(logs / "profile", rank, window, trainer.device, plan.mesh) \
        if window is not None else None
    ckpt = Path(directory) / "checkpoints"
    if resume:
        trainer.resume(ckpt)
    try:
        losses = trainer.train(steps, checkpoint_dir=ckpt,
                               checkpoint_every=options.checkpoint_every, evaluate=evaluate,
                               eval_every=int(training["eval_every"]), profiler=profiler,
                               keep_last=int(training["keep_last"]),
                               final_save=bool(training["final_save"]))
    except (RuntimeError, dist.DistBackendError, ConnectionError) as exc:
        if world == 1:
            raise
        raise RunFailure(failure_line(exc, trainer, plan, logs, ckpt)) from None
    if trainer.rank == 0:
        summary = getattr(trainer, "profile_summary", None)
        if summary is not None:
            click.echo(summary_text(summary))
            click.echo(f"traces and summary in {logs / 'profile'}; compare with the plan: "
                       f"autopar report {directory} --run")
        click.echo(f"trained {steps} steps on {world} x {kind}: loss {losses[0]:.4f} -> "
                   f"{losses[-1]:.4f}; log {logs / 'train.jsonl'}")


def failure_line(exc: BaseException, trainer, plan, logs: Path, ckpt: Path) -> str:
    """The one line a failed rank ends with: what happened at which step, the start of the
    error, where its whole text is (DIR/logs/error-rank<N>.txt, and torchrun's error file so
    that its summary names the root cause), and advice that fits: an out-of-memory error is
    not fixed by resuming."""
    rank = trainer.rank
    full_text = "".join(traceback.format_exception(exc))
    where = logs / f"error-rank{rank}.txt"
    try:
        logs.mkdir(parents=True, exist_ok=True)
        where.write_text(full_text)
    except OSError:
        where = None
    ErrorHandler().record_exception(exc)  # TORCHELASTIC_ERROR_FILE, when torchrun set one
    reason = " ".join(str(exc).split())
    reason = reason if len(reason) <= 300 else reason[:297] + "..."
    oom = isinstance(exc, torch_oom()) or "out of memory" in reason.lower()
    lost = not oom and (isinstance(exc, (dist.DistBackendError, ConnectionError)) or any(
        word in reason.lower() for word in ("connection", "peer", "timed out", "gloo")))
    what = ("ran out of memory" if oom else "lost its peers" if lost else "failed") + \
        f" at step {trainer.step_index}"
    cause = "" if oom else ("a process died or the network failed: " if lost
                            else "an error on this rank: ")
    whole = f"; whole error in {where}" if where is not None else ""
    if oom:
        predicted = plan.predicted.memory.get("total", 0.0) if plan.predicted else 0.0
        advice = (f"the plan predicts {fmt.nbytes(predicted)} on the busiest device of "
                  f"{fmt.nbytes(plan.memory_limit_bytes)} usable; re-plan leaner (autopar "
                  f"compile ... --memory-limit-gb N below what this device really has, or "
                  f"--constraints recompute=full,microbatch_size=1)")
    else:
        last = latest_checkpoint(ckpt)
        advice = f"last complete checkpoint: {last or 'none'}; relaunch with --resume"
    return f"rank {rank} {what} ({cause}{reason}){whole}; {advice}"


def torch_oom() -> type[BaseException]:
    """torch's out-of-memory error type (any accelerator)."""
    return getattr(torch, "OutOfMemoryError", MemoryError)


def _refuse_unasked_overwrite(directory: str, resume: bool, overwrite: bool) -> None:
    """A new run (no --resume) in a directory whose checkpoints an earlier run wrote would
    replace them step by step and move ``latest``: refused unless asked for."""
    ckpt = Path(directory) / "checkpoints"
    last = latest_checkpoint(ckpt)
    if last is not None and not resume and not overwrite:
        raise PlanError(f"{ckpt} holds {last.name} from an earlier run; pass --resume to "
                        f"continue it, or --overwrite to start a new run (it replaces those "
                        f"checkpoints as it saves)")


def _evaluator(held, trainer):
    """``evaluate(trainer)`` over the held-out data (opened and checked now), or None."""
    if held is None:
        return None

    if trainer.task.classifies:
        raise PlanError("--eval measures a language model's loss and perplexity on held-out "
                        "tokens; this model is a classifier: drop --eval")
    data = held_out_source(held, trainer.vocab)
    return lambda t: evaluate(t, held, data)


def teardown(world: int, finished: bool) -> None:
    """End a finished run in order: what held the process groups is freed first (the model,
    its DDP reducer: the caller's objects are out of scope by now), then a barrier (gloo
    aborts a process whose peer destroys its threads mid-exchange), then every group is
    destroyed while the interpreter is whole. A failed or interrupted run destroys nothing:
    a peer may still be inside a collective, which a group's shutdown would wait on, and the
    process exits next (autopar.cli.end_process) with its threads."""
    if not finished:
        return
    gc.collect()
    if world > 1 and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def fail_message(message: str, ctx: click.Context | None) -> str:
    """One line: ``autopar: error: <cause and fix>``."""
    text = " ".join(message.split())
    hint = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
    return f"autopar: error: {text}{hint}"


def end_process(code: int) -> NoReturn:
    """Exit with ``code``. A process that joined a process group (a rank of a torchrun job)
    has ended its run by now (autopar run's teardown destroys the groups after a finished
    run) and leaves without interpreter finalization, its output flushed first.

    Why: torch keeps the device meshes in module-level caches (DTensor's sharding cache),
    and the meshes keep the gloo/NCCL groups, so their C++ threads are still alive at exit
    (measured: 4 gloo groups' threads per rank after destroy_process_group). A normal exit
    frees them during finalization, where a C++ thread that needs the GIL is unwound and
    std::terminate aborts the process ("terminate called without an active exception",
    SIGABRT) after a run that trained every step; torchrun then reports the job failed."""
    if joined_process_group():
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # a closed pipe: nothing left to say
                stream.flush()
        logging.shutdown()
        os._exit(code)
    sys.exit(code)
