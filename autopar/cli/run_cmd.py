"""``autopar run DIR``: train an artifact under torchrun (or as one process)."""

from __future__ import annotations

import os
from datetime import timedelta

import click

_BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}


def _device_type(cluster: str, override: str | None) -> str:
    if override:
        return override
    from autopar.cost.hardware import load_cluster
    from autopar.errors import PlanError

    try:
        return load_cluster(cluster).device.type
    except PlanError:  # a profile file from another machine: run where we are
        return "cpu"


def _program(directory: str, manifest: dict, plan) -> object:
    """The training program to run, as a module: DIR/train.py as autopar wrote it, regenerated
    when plan.yaml changed since (one process per machine writes it), or as the user edited
    it (kept, and said so)."""
    from pathlib import Path

    from autopar.codegen import PROGRAM_FILE, load_program, program_state, regenerate_program
    from autopar.codegen.program import digest
    from autopar.errors import PlanError

    path = Path(directory) / PROGRAM_FILE
    state = program_state(directory)
    speak = int(os.environ.get("RANK", "0")) == 0
    note = None
    if state in ("missing", "stale"):
        writer = int(os.environ.get("LOCAL_RANK", "0")) == 0
        text = regenerate_program(directory, plan, manifest, write=writer)
        note = (f"{PROGRAM_FILE} was missing" if state == "missing" else
                f"plan.yaml changed since {PROGRAM_FILE} was generated") + ": regenerated it"
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
    if note and speak:
        click.echo(f"autopar: {note}", err=True)
    return program


@click.command("run")
@click.argument("directory", type=click.Path(file_okay=False))
@click.option("--steps", default=10, show_default=True, type=click.IntRange(min=1))
@click.option("--data", default="synthetic", show_default=True,
              help="'synthetic' (deterministic random tokens) or a token dataset PREFIX from "
                   "`autopar data prepare`.")
@click.option("--seed", default=0, show_default=True, type=int,
              help="Seeds the weights and the synthetic data.")
@click.option("--lr", default=1e-3, show_default=True, type=float)
@click.option("--device", type=click.Choice(sorted(_BACKENDS)), default=None,
              help="Device type [default: the plan cluster's].")
@click.option("--checkpoint-every", default=0, show_default=True, type=click.IntRange(min=0),
              help="Save DIR/checkpoints every N steps (and always at the end).")
@click.option("--resume", is_flag=True,
              help="Continue from the latest checkpoint in DIR/checkpoints (any plan's).")
@click.option("--init-from", type=click.Path(exists=True), default=None,
              help="Start from a Hugging Face checkpoint (a save_pretrained folder of "
                   "safetensors): each rank reads only its slices.")
def run_cmd(directory: str, steps: int, data: str, seed: int, lr: float,
            device: str | None, checkpoint_every: int, resume: bool,
            init_from: str | None) -> None:
    """Train the artifact in DIRECTORY with its program (DIR/train.py); one JSON line per step
    goes to DIR/logs/train.jsonl.

    The program is regenerated when plan.yaml changed since it was written; once edited by
    hand it is run as it is.

    \b
    Examples:
      torchrun --nproc-per-node 4 -m autopar run autopar-tiny-llama-4 --steps 20 --device cpu
      torchrun --nproc-per-node 2 -m autopar run DIR --steps 10 --resume   # after re-planning
      torchrun --nnodes 2 --nproc-per-node 8 ... -m autopar run DIR --steps 1000
      torchrun --nproc-per-node 4 -m autopar run DIR --init-from ./Llama-3.2-1B
    """
    from pathlib import Path

    import torch.distributed as dist

    from autopar.codegen import load_artifact
    from autopar.errors import PlanError, RunFailure
    from autopar.runtime import Trainer

    manifest, plan = load_artifact(directory)
    from autopar.plan.support import refuse_unsupported

    refuse_unsupported(plan)  # before any program is (re)generated
    program = _program(directory, manifest, plan)
    if resume and init_from and int(os.environ.get("RANK", "0")) == 0:
        click.echo("autopar: --resume continues from DIR/checkpoints; --init-from is not read",
                   err=True)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != plan.devices:
        raise PlanError(f"the plan is for {plan.devices} devices but {world} processes are "
                        f"running; launch with torchrun --nproc-per-node {plan.devices}")
    kind = _device_type(plan.cluster, device)
    if kind != "cpu":  # this process's accelerator, before any collective needs it
        import torch

        torch.accelerator.set_device_index(int(os.environ.get("LOCAL_RANK", "0")))
    if world > 1:
        dist.init_process_group(_BACKENDS[kind], timeout=timedelta(seconds=120))
    finished = False
    try:
        log = Path(directory) / "logs" / "train.jsonl"
        trainer = Trainer(manifest["model"], plan, program=program, device=kind, seed=seed,
                          lr=lr, log_path=log, data=data,
                          init_from=None if resume else init_from)
        ckpt = Path(directory) / "checkpoints"
        if resume:
            trainer.resume(ckpt)
        try:
            losses = trainer.train(steps, checkpoint_dir=ckpt,
                                   checkpoint_every=checkpoint_every)
        except (RuntimeError, dist.DistBackendError, ConnectionError) as exc:
            if world == 1:
                raise
            from autopar.runtime.checkpoint import latest_checkpoint

            last = latest_checkpoint(ckpt)
            reason = " ".join(str(exc).split())[:200]
            lost = isinstance(exc, (dist.DistBackendError, ConnectionError)) or any(
                word in reason.lower() for word in ("connection", "peer", "timed out", "gloo"))
            what = ("lost its peers" if lost else "failed") + f" at step {trainer.step_index}"
            cause = "a process died or the network failed" if lost else "an error on this rank"
            raise RunFailure(
                f"rank {trainer.rank} {what} ({cause}: {reason}); last complete checkpoint: "
                f"{last or 'none'}; relaunch with --resume") from None
        if trainer.rank == 0:
            click.echo(f"trained {steps} steps on {world} x {kind}: loss {losses[0]:.4f} -> "
                       f"{losses[-1]:.4f}; log {log}")
        finished = True
    finally:
        if world > 1 and dist.is_initialized():
            if finished:
                # every rank reaches teardown before any tears down: gloo aborts a process
                # whose peer destroys its threads mid-exchange
                dist.barrier()
            dist.destroy_process_group()
