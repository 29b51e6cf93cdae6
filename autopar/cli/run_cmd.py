"""``autopar run DIR``: train an artifact under torchrun (or as one process); ``--generate``
serves a generation artifact (compiled with ``--task infer``) from its generate.py."""

from __future__ import annotations

import os
from pathlib import Path

import click

from autopar.calibrate.profiling import StepProfiler
from autopar.cli.common import init_process_group
from autopar.cli.train_options import hyperparameters, profile_window, training_options
from autopar.plan.launch import plan_launch
from autopar.train.run_log import RunLog, archive_logs

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


def _program(directory: str, manifest: dict, plan, needs: tuple[str, ...] = ()) -> object:
    """The program to run, as a module: DIR/train.py (DIR/generate.py for a plan of task
    "infer") as autopar wrote it, regenerated when plan.yaml changed since (one process per
    machine writes it), or as the user edited it (kept, and said so); refused in one line when
    it lacks a function of ``needs``."""
    from pathlib import Path

    from autopar.codegen import load_program, program_file, program_state, regenerate_program
    from autopar.artifact import digest
    from autopar.errors import PlanError

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


@click.command("run")
@click.argument("directory", type=click.Path(file_okay=False))
@click.option("--steps", default=10, show_default=True, type=click.IntRange(min=1))
@click.option("--data", default="synthetic", show_default=True,
              help="'synthetic' (deterministic random tokens; a classifier's: random "
                   "samples and labels) or a token dataset PREFIX from `autopar data prepare`.")
@click.option("--seed", default=0, show_default=True, type=int,
              help="Seeds the weights and the synthetic data (with --generate: the "
                   "sampling draws).")
@click.option("--device", type=click.Choice(sorted(_BACKENDS)), default=None,
              help="Device type [default: the plan cluster's].")
@click.option("--checkpoint-every", default=0, show_default=True, type=click.IntRange(min=0),
              help="Save DIR/checkpoints every N steps (and always at the end).")
@click.option("--keep-last", default=0, show_default=True, type=click.IntRange(min=0),
              help="Keep only the newest N checkpoints in DIR/checkpoints (0: keep all).")
@click.option("--no-final-save", "final_save", is_flag=True, default=True, flag_value=False,
              help="Do not save a checkpoint after the last step (--checkpoint-every still "
                   "saves).")
@click.option("--overwrite", is_flag=True,
              help="Start a new run in a DIR whose checkpoints came from an earlier one (they "
                   "are replaced as this run saves); without it such a run is refused.")
@click.option("--timeout", "timeout_s", default=600, show_default=True,
              type=click.IntRange(min=1),
              help="Seconds a collective may wait for its peers before the job fails (first "
                   "steps may compile kernels or load large checkpoints).")
@click.option("--resume", is_flag=True,
              help="Continue from the latest checkpoint in DIR/checkpoints (any plan's).")
@click.option("--init-from", type=click.Path(exists=True), default=None,
              help="Start from a Hugging Face checkpoint (a save_pretrained folder of "
                   "safetensors): each rank reads only its slices.")
@click.option("--generate", "serving", is_flag=True,
              help="Serve a generation artifact (compiled with --task infer) with its "
                   "generate.py: the latest checkpoint's weights, else the seed-0 ones.")
@click.option("--prompts", default=None,
              help="With --generate: JSONL of {\"ids\": [...]} or {\"prompt\": \"...\"} lines, "
                   "or a text file of one prompt per line.")
@click.option("--max-new-tokens", default=32, show_default=True, type=int,
              help="With --generate: new tokens per prompt, at most.")
@click.option("--sample", is_flag=True, help="With --generate: sample instead of greedy "
                                             "decoding (--seed seeds the draws).")
@click.option("--temperature", default=1.0, show_default=True, type=float)
@click.option("--top-k", type=int, default=None)
@click.option("--top-p", type=float, default=None)
@click.option("--eos", "eos_token_id", type=int, default=None,
              help="With --generate: the stop token id.")
@click.option("--tokenizer", default=None,
              help="With --generate: a Hugging Face tokenizer folder for text prompts and "
                   "output.")
@training_options
def run_cmd(directory: str, steps: int, data: str, seed: int,
            device: str | None, checkpoint_every: int, resume: bool,
            init_from: str | None, serving: bool, prompts: str | None, max_new_tokens: int,
            sample: bool, temperature: float, top_k: int | None, top_p: float | None,
            eos_token_id: int | None, tokenizer: str | None, **training: object) -> None:
    """Train the artifact in DIRECTORY with its program (DIR/train.py): a console line per
    step (loss, learning rate, tokens/s, MFU, memory, ETA) and one JSON line per step in
    DIR/logs/train.jsonl (TensorBoard events in DIR/logs/tensorboard when tensorboard is
    installed); --eval adds validation loss and perplexity (DIR/logs/eval.jsonl); --profile a
    trace per rank and a per-stage summary (DIR/logs/profile). With --generate, serve a
    generation artifact (compiled with --task infer) with its program (DIR/generate.py): one
    JSON line per prompt with its new token ids on stdout, tokens/s on stderr.

    The program is regenerated when plan.yaml changed since it was written; once edited by
    hand it is run as it is.

    \b
    Examples:
      torchrun --nproc-per-node 4 -m autopar run autopar-tiny-llama-4 --steps 20 --device cpu
      torchrun --nproc-per-node 2 -m autopar run DIR --steps 10 --resume   # after re-planning
      torchrun --nnodes 2 --nproc-per-node 8 ... -m autopar run DIR --steps 1000
      torchrun --nproc-per-node 4 -m autopar run DIR --init-from ./Llama-3.2-1B
      torchrun --nproc-per-node 4 -m autopar run DIR --steps 1000 --lr 3e-4 \\
          --warmup-steps 100 --lr-schedule cosine --weight-decay 0.1 --betas 0.9,0.95
      torchrun --nproc-per-node 4 -m autopar run DIR --eval val --eval-every 100
      torchrun --nproc-per-node 4 -m autopar run DIR --steps 8 --profile   # then report --run
      autopar run SERVE_DIR --generate --prompts prompts.jsonl --max-new-tokens 64
      torchrun --nproc-per-node 2 -m autopar run SERVE_DIR --generate --prompts p.jsonl --sample
    """


    from autopar.artifact import load_artifact
    from autopar.errors import PlanError

    manifest, plan = load_artifact(directory)
    from autopar.plan.support import refuse_unsupported

    refuse_unsupported(plan)  # before any program is (re)generated
    if serving or plan.task == "infer":
        if resume or init_from:
            raise PlanError("--resume and --init-from are for training; --generate serves the "
                            "artifact's latest checkpoint: drop them")
        options = dict(max_new_tokens=max_new_tokens, do_sample=sample,
                       temperature=temperature, top_k=top_k, top_p=top_p,
                       eos_token_id=eos_token_id, seed=seed)
        _serve(directory, manifest, plan, device, prompts, tokenizer, options,
               int(training["timeout_s"]))
        return
    if prompts is not None:
        raise PlanError(f"--prompts goes with --generate, which serves an artifact compiled "
                        f"with --task infer; {directory} trains (task {plan.task})")
    hyper = hyperparameters(training)  # bad settings fail before any process group
    if not resume:
        hyper.with_horizon(steps)  # a warm-up longer than the run is refused here
    window = profile_window(steps, training["profile_steps"]) if training["profile"] \
        else None
    held = None
    if training["eval_source"] is not None:
        from autopar.train.evaluate import HeldOut

        held = HeldOut(str(training["eval_source"]), int(training["eval_batches"]))
    elif training["eval_every"]:
        raise PlanError("--eval-every needs --eval PATH|synthetic: the held-out data")
    program = _program(directory, manifest, plan)
    if resume and init_from and int(os.environ.get("RANK", "0")) == 0:
        click.echo("autopar: --resume continues from DIR/checkpoints; --init-from is not read",
                   err=True)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != plan.devices:
        raise PlanError(f"the plan is for {plan.devices} devices but {world} processes are "
                        f"running; launch with {plan_launch(plan.devices, plan.cluster)}")
    _refuse_unasked_overwrite(directory, resume, bool(training["overwrite"]))
    if not resume and int(os.environ.get("RANK", "0")) == 0:
        # one log per run: an earlier run's go to logs/runs/<its id> (before any rank can
        # start writing: the others wait for rank 0 in the process group's start)
        archive_logs(Path(directory) / "logs")
    kind = _device_type(plan.cluster, device)
    if kind != "cpu":  # this process's accelerator, before any collective needs it
        import torch

        if not torch.accelerator.is_available():
            raise PlanError(f"the plan is for {plan.cluster} ({kind}) but this machine has no "
                            f"accelerator; add --device cpu to run it on CPU processes")
        torch.accelerator.set_device_index(int(os.environ.get("LOCAL_RANK", "0")))
    if world > 1:
        init_process_group(_BACKENDS[kind], int(training["timeout_s"]))
    finished = False
    try:
        _train(directory, manifest, plan, program, kind, world, steps, data, seed, hyper,
               held, window, resume, init_from, checkpoint_every, training)
        finished = True
    finally:
        # _train has returned: its trainer and model are unreferenced, so _teardown's
        # collection frees them (and a DDP reducer's hold on a group) before the groups go
        _teardown(world, finished)


def _train(directory: str, manifest: dict, plan, program, kind: str, world: int, steps: int,
           data: str, seed: int, hyper, held, window: tuple[int, int] | None, resume: bool,
           init_from: str | None, checkpoint_every: int, training: dict) -> None:
    """The run between process-group start and teardown: build the trainer, train, report
    on rank 0. A lost peer or a failing step becomes one RunFailure line."""
    from pathlib import Path

    import torch.distributed as dist

    from autopar.errors import RunFailure
    from autopar.train import Trainer

    logs = Path(directory) / "logs"
    rank = int(os.environ.get("RANK", "0"))
    run_log = RunLog(logs, console=not training["quiet"], tensorboard=True,
                     every=int(training["log_every"]), resume=resume) if rank == 0 else None
    trainer = Trainer(manifest["model"], plan, program=program, device=kind, seed=seed,
                      hyper=hyper, log=run_log, data=data,
                      init_from=None if resume else init_from)
    evaluate = _evaluator(held, trainer)  # held-out data checked before any step
    profiler = StepProfiler(logs / "profile", rank, window, trainer.device, plan.mesh) \
        if window is not None else None
    ckpt = Path(directory) / "checkpoints"
    if resume:
        trainer.resume(ckpt)
    try:
        losses = trainer.train(steps, checkpoint_dir=ckpt,
                               checkpoint_every=checkpoint_every, evaluate=evaluate,
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
            from autopar.calibrate.profiling import summary_text

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
    import traceback

    import torch.distributed as dist
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

    from autopar.report import fmt
    from autopar.train.checkpoint import latest_checkpoint

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
    import torch

    return getattr(torch, "OutOfMemoryError", MemoryError)


def _refuse_unasked_overwrite(directory: str, resume: bool, overwrite: bool) -> None:
    """A new run (no --resume) in a directory whose checkpoints an earlier run wrote would
    replace them step by step and move ``latest``: refused unless asked for."""
    from autopar.errors import PlanError
    from autopar.train.checkpoint import latest_checkpoint

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
    from autopar.errors import PlanError
    from autopar.train.evaluate import evaluate, held_out_source

    if trainer.task.classifies:
        raise PlanError("--eval measures a language model's loss and perplexity on held-out "
                        "tokens; this model is a classifier: drop --eval")
    data = held_out_source(held, trainer.vocab)
    return lambda t: evaluate(t, held, data)


def _serve(directory: str, manifest: dict, plan, device: str | None, prompts: str | None,
           tokenizer: str | None, options: dict, timeout_s: int = 600) -> None:
    """``autopar run DIR --generate``: every input checked first, then DIR/generate.py
    (regenerated or kept as for train.py) serves the prompts under the plan's processes."""

    from autopar.cli.generate_cmd import print_generated, read_prompts
    from autopar.errors import PlanError
    from autopar.serve.generate import check_sampling, check_servable, serve, serving_model
    from autopar.train.trainer import run_device

    if plan.task != "infer":
        raise PlanError(f"{directory} was compiled for --task {plan.task}; --generate serves an "
                        f"artifact compiled with --task infer (autopar compile MODEL --task "
                        f"infer --out DIR), or generate from this one with autopar generate "
                        f"{directory} --prompts FILE")
    if prompts is None:
        raise PlanError(f"{directory} is a serving artifact (compiled with --task infer) and "
                        f"needs prompts: autopar run {directory} --generate --prompts FILE")
    check_servable(plan, manifest["model"])
    check_sampling(options["max_new_tokens"], options["do_sample"], options["temperature"],
                   options["top_k"], options["top_p"])
    tok = None
    if tokenizer is not None:
        from autopar.data.instruction import load_hf_tokenizer

        tok = load_hf_tokenizer(tokenizer)
    ids = read_prompts(prompts, tok)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != plan.devices:
        launch = plan_launch(plan.devices, plan.cluster) if plan.devices > 1 else \
            "one process, without torchrun"
        raise PlanError(f"the plan is for {plan.devices} devices but {world} processes are "
                        f"running; launch with {launch}")
    program = _program(directory, manifest, plan, needs=("build_mesh", "parallelize",
                                                         "generate"))
    kind = _device_type(plan.cluster, device)
    if kind != "cpu":
        import torch

        if not torch.accelerator.is_available():
            raise PlanError(f"the plan is for {plan.cluster} ({kind}) but this machine has no "
                            f"accelerator; add --device cpu to run it on CPU processes")
        torch.accelerator.set_device_index(int(os.environ.get("LOCAL_RANK", "0")))
    if world > 1:
        init_process_group(_BACKENDS[kind], timeout_s)
    finished = False
    try:
        model = serving_model(directory, run_device(kind))
        rows, seconds = serve(program, model, ids, device=kind, **options)
        finished = True
    finally:
        _teardown(world, finished)
    if int(os.environ.get("RANK", "0")) == 0:
        print_generated(rows, tok, seconds)


def _teardown(world: int, finished: bool) -> None:
    """End a finished run in order: what held the process groups is freed first (the model,
    its DDP reducer: the caller's objects are out of scope by now), then a barrier (gloo
    aborts a process whose peer destroys its threads mid-exchange), then every group is
    destroyed while the interpreter is whole. A failed or interrupted run destroys nothing:
    a peer may still be inside a collective, which a group's shutdown would wait on, and the
    process exits next (autopar.cli.end_process) with its threads."""
    import gc

    import torch.distributed as dist

    if not finished:
        return
    gc.collect()
    if world > 1 and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
