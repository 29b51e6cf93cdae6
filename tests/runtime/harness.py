"""Run a Trainer on N local gloo processes (spawned, bounded, no leftovers)."""

from __future__ import annotations

import os
import queue
from datetime import timedelta

import torch.multiprocessing as mp

from autopar.cost.profile_comm import free_port


def _worker(rank: int, port: int, out, world: int, source: dict, plan_dict: dict, steps: int,
            seed: int, checkpoint_dir: str | None = None, resume: bool = False,
            data: str = "synthetic", probe=None, program: str = "",
            first_grads: bool = False, init_from: str | None = None) -> None:
    run_in_group(rank, port, out, world, _train, world, source, plan_dict, steps, seed,
                 checkpoint_dir, resume, data, probe, program, first_grads, init_from)


def _train(world: int, source: dict, plan_dict: dict, steps: int, seed: int,
           checkpoint_dir: str | None, resume: bool, data: str, probe, program: str,
           first_grads: bool, init_from: str | None) -> tuple:
    import torch.distributed as dist

    from autopar.codegen import load_program
    from autopar.plan import Plan
    from autopar.runtime import Trainer

    trainer = Trainer(source, Plan.from_dict(plan_dict), program=load_program(program),
                      device="cpu", seed=seed, data=data, init_from=init_from)
    if resume:
        trainer.resume(checkpoint_dir)
    captured: dict = {}
    if first_grads:
        _capture_first_gradients(trainer, captured)
    losses = trainer.train(steps, checkpoint_dir=checkpoint_dir)
    sharded = sum(1 for p in trainer.model.parameters() if hasattr(p, "device_mesh")
                  and any(pl.is_shard() for pl in p.placements))
    probed = probe(trainer) if probe is not None else None  # on every rank: it may assert
    grads = None
    if first_grads:  # every rank's, merged: pipeline ranks hold different parameters
        everyone: list = [captured]
        if world > 1:
            everyone = [None] * world
            dist.all_gather_object(everyone, captured)
        grads = {k: v for d in everyone for k, v in d.items()}
    extra = [x for x in (grads, probed) if x is not None]
    return (losses, sharded, *extra)


def run_in_group(rank: int, port: int, out, world: int, body, *args) -> None:
    """The frame of a rank's test process: one thread, the gloo group (world > 1), then
    ``body(*args)``; rank 0 reports its result on ``out`` as ("ok", result), any rank its
    error as ("error", text); the group is always torn down."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        if world > 1:
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            dist.init_process_group("gloo", rank=rank, world_size=world,
                                    timeout=timedelta(seconds=60))
        result = body(*args)
        if world > 1:
            dist.barrier()  # all ranks done before any tears gloo down
        if rank == 0:
            out.put(("ok", result))
    except Exception as exc:  # reported to the test as text
        import traceback

        out.put(("error", f"rank {rank}: {type(exc).__name__}: {exc}\n"
                          f"{''.join(traceback.format_exc()[-30000:])}"))
    finally:
        if world > 1 and dist.is_initialized():
            dist.destroy_process_group()


def _capture_first_gradients(trainer, into: dict) -> None:
    """Record every parameter's full gradient as the first optimizer step sees it (after the
    gradient sync and clipping), keyed by its name in the plain model."""
    import torch

    from autopar.runtime.tp_styles import FUSED_ATTR

    step = trainer.optimizer.step

    def capture(*args, **kwargs):
        if not into:
            for name, p in trainer.model.named_parameters():
                g = p.grad
                if g is None:
                    continue
                g = g.full_tensor() if hasattr(g, "full_tensor") else g
                owner, _, leaf = name.rpartition(".")
                fused = getattr(trainer.model.get_submodule(owner), FUSED_ATTR, {}).get(leaf)
                if fused is not None:  # a fused projection's rows, back in model order
                    dim, rows = fused
                    g = g.index_select(dim, torch.argsort(rows.to(g.device)))
                name = name.removeprefix("module.")
                if trainer.pipe is not None:  # drop the stage's ModuleList index
                    name = name.split(".", 1)[1]
                name = ".".join(p for p in name.split(".") if p not in
                                ("_checkpoint_wrapped_module", "_fsdp_wrapped_module"))
                # numpy pickles by value: a tensor would travel as shared memory
                into[name] = g.detach().float().numpy().copy()
        return step(*args, **kwargs)

    trainer.optimizer.step = capture


def rank_context():
    """A forkserver that imported torch, transformers and the runtime once: each rank then
    starts in milliseconds instead of re-importing them (seconds per rank on 2 cores)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "transformers",
                                "autopar.runtime", "tests.runtime.harness"])
    return ctx


def spawn_ranks(target, world: int, args: tuple = (), timeout_s: float = 180.0,
                replies: int = 1) -> list:
    """Run ``target(rank, port, out, *args)`` on ``world`` local ranks and return the payloads of
    the first ``replies`` messages each rank puts on ``out`` as ("ok", payload) (or
    ("error", text), raised here as RuntimeError). The processes are always reaped."""
    ctx = rank_context()
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, port, out, *args), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    payloads = []
    try:
        for _ in range(replies):
            status, payload = out.get(timeout=timeout_s)
            if status != "ok":
                raise RuntimeError(payload)
            payloads.append(payload)
    except queue.Empty:
        raise TimeoutError(f"no result from {world} ranks in {timeout_s} s") from None
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    return payloads


def run_ranks(source: dict, plan, steps: int = 5, seed: int = 0, timeout_s: float = 180.0,
              checkpoint_dir: str | None = None, resume: bool = False, data: str = "synthetic",
              probe=None, first_grads: bool = False, init_from: str | None = None) -> tuple:
    """(losses of rank 0 after ``steps`` steps of ``plan`` on ``plan.devices`` processes, how
    many of its parameters are sharded DTensors). Every rank runs the program autopar
    generates for ``plan`` (what train.py holds). ``probe``, a module-level function of the
    Trainer, runs on every rank after training (collectives allowed); rank 0's result is
    appended; with ``first_grads``, every parameter's gradient at the first optimizer step
    (all ranks', by plain-model name) is appended first. ``init_from``: a Hugging Face
    checkpoint folder the weights are loaded from."""
    from autopar.codegen import program_text

    program = program_text(plan, source)
    return spawn_ranks(_worker, plan.devices,
                       (plan.devices, source, plan.to_dict(), steps, seed, checkpoint_dir, resume,
                        data, probe, program, first_grads, init_from), timeout_s)[0]
