"""Distributed checkpoints (torch.distributed.checkpoint) that load under any plan.

Layout: CKPT_DIR/step_000004/ (DCP files + meta.json) and CKPT_DIR/latest (the name of the
last complete one). A checkpoint is written to step_N.partial and renamed only after every
rank has finished, and `latest` is replaced atomically after that: a half-written checkpoint
never shadows the last good one.

Every plan writes the same keys: ``model.<fqn>`` for the original model's state_dict and
``optim.state.<fqn>.<name>`` / ``optim.param_groups.<fqn>.<name>`` for the optimizer
(get_state_dict with ``flatten_optimizer_state_dict``: one entry per parameter, so ranks that
hold different parameters - pipeline stages, ZeRO-1 partitions - each write their own and DCP
merges them). A pipeline stage's FQNs lose their ModuleList index; the optimizer state of a
tied parameter is stored once, under its first name, as get_state_dict does for the whole model.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from autopar.errors import PlanError
from autopar.files import fsync_dir, fsync_file
from autopar.parallel.expert_zero import ExpertZeroOptimizer
from autopar.parallel.init import canonical_fqn
from autopar.parallel.tp_styles import FUSED_ATTR

if TYPE_CHECKING:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from autopar.parallel.expert_zero import ExpertZeroOptimizer
    from autopar.train.trainer import Trainer

REPLACED = ".replaced"  # suffix of a checkpoint moved aside while one of its step replaces it
LAYOUT = 2  # 1: unflattened optimizer state (param_groups by index), before pp/ZeRO-1 support
_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _zero1(trainer: Trainer) -> ZeroRedundancyOptimizer | ExpertZeroOptimizer | None:
    """The trainer's ZeRO-1 optimizer (its ``optim`` holds this rank's partition), or None."""
    from torch.distributed.optim import ZeroRedundancyOptimizer  # noqa: F811

    opt = trainer.optimizer
    return opt if isinstance(opt, (ZeroRedundancyOptimizer, ExpertZeroOptimizer)) else None


def _copy_hyperparameters(src: list[dict], dst: list[dict]) -> None:
    for s, d in zip(src, dst, strict=True):
        d.update({k: v for k, v in s.items() if k != "params"})


def _rank_optimizer(trainer: Trainer) -> torch.optim.Optimizer:
    """The optimizer holding this rank's state: a ZeRO-1 rank's partition, else the whole one."""
    zero = _zero1(trainer)
    if zero is None:
        return trainer.optimizer
    # the LR schedule updates the wrapper's groups; the partition's copy lags until its next step
    _copy_hyperparameters(zero.param_groups, zero.optim.param_groups)
    return zero.optim


@contextlib.contextmanager
def _without_empty_groups(optim: torch.optim.Optimizer):
    """The optimizer without its parameter groups that hold nothing on this rank, for the
    state-dict functions (which read a group's hyperparameters off its first parameter): a
    ZeRO-1 rank's share of the no-decay group can be empty. The groups are back after."""
    groups = optim.param_groups
    optim.param_groups = [g for g in groups if g["params"]]
    try:
        yield
    finally:
        optim.param_groups = groups


def _disk_keys(trainer: Trainer, local: dict) -> dict[str, list[str]]:
    """Checkpoint key -> the local keys holding its value (several for tied pipeline copies)."""
    if trainer.pipe is None:
        return {key: [key] for key in local}
    tied = getattr(trainer, "tied", {})
    fqns = {k[len("model."):] for k in local if k.startswith("model.")}
    out: dict[str, list[str]] = {}
    for key in local:
        part, rest = key.split(".", 1)
        if part == "model":
            # drop the stage's ModuleList index; every name of a tied weight stays, as in the
            # model's own state_dict
            disk = f"model.{rest.split('.', 1)[1]}"
            if disk[len("model."):] not in getattr(trainer, "state_keys", (disk[6:],)):
                continue  # a non-persistent buffer the trace registered (rotary inv_freq)
        else:
            section, tail = rest.split(".", 1)
            # the parameter's FQN is the longest key prefix the model has (names contain dots)
            cut = max(i for i in range(len(tail)) if tail[i] == "." and tail[:i] in fqns)
            name = tail[:cut].split(".", 1)[1]
            disk = f"optim.{section}.{tied.get(name, (name,))[0]}{tail[cut:]}"
        out.setdefault(disk, []).append(key)
    return out


def _local_state(trainer: Trainer, options: StateDictOptions = _FLAT
                 ) -> tuple[torch.optim.Optimizer, dict[str, object]]:
    """(the optimizer this rank loads into, its state as {"model.<fqn>" / "optim.<key>": value})."""
    optim = _rank_optimizer(trainer)
    with _without_empty_groups(optim):
        model_sd, optim_sd = get_state_dict(trainer.model, optim, options=options)
    local: dict[str, object] = {f"model.{k}": v for k, v in model_sd.items()}
    local.update({f"optim.{k}": v for k, v in optim_sd.items()})
    return optim, local


def _split(local: dict[str, object]) -> tuple[dict, dict]:
    model_sd = {k[len("model."):]: v for k, v in local.items() if k.startswith("model.")}
    optim_sd = {k[len("optim."):]: v for k, v in local.items() if k.startswith("optim.")}
    return model_sd, optim_sd


def _param_names(keys) -> list[str]:
    """The model's FQNs (from checkpoint keys) over all ranks: a pipeline rank holds only its
    stages'."""
    names = {k[len("model."):] for k in keys if k.startswith("model.")}
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, sorted(names))
        names = set().union(*gathered)
    return sorted(names)


def _fused_rows(trainer: Trainer) -> dict[str, tuple[int, torch.Tensor]]:
    """Checkpoint FQN -> (dim, row order) of each parameter a fused projection holds in
    per-part order (tp_styles): the checkpoint stores the model's own order instead, so that
    any plan can load it."""
    out = {}
    for name, module in trainer.model.named_modules():
        rows = getattr(module, FUSED_ATTR, None)
        if not rows:
            continue
        path = canonical_fqn(name)
        if trainer.pipe is not None:  # drop the stage's ModuleList index
            path = path.split(".", 1)[1]
        for attr, (dim, index) in rows.items():
            if getattr(module, attr, None) is not None:
                out[f"{path}.{attr}"] = (dim, index)
    return out


def _reorder(value: object, dim: int, order: torch.Tensor) -> object:
    """``value`` (a DTensor shaped like the parameter) with its rows in ``order`` along
    ``dim``: gathered whole for one parameter at a time, then laid out as before."""
    from torch.distributed.tensor import distribute_tensor

    if not _reorderable(value, dim, order):
        return value  # e.g. the optimizer's step counter
    full = value.full_tensor().index_select(dim, order.to(value.device))
    return distribute_tensor(full, value.device_mesh, value.placements, src_data_rank=None)


def _reorderable(value: object, dim: int, order: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor) and value.dim() > dim and value.shape[dim] == order.numel()


def _fused_key(key: str, fused: dict) -> str | None:
    """The fused parameter a checkpoint key holds (itself, or its optimizer state)."""
    if key.startswith("model."):
        name = key[len("model."):]
        return name if name in fused else None
    if key.startswith("optim.state."):
        name = key[len("optim.state."):].rsplit(".", 1)[0]
        return name if name in fused else None
    return None


def save_checkpoint(trainer: Trainer, directory: str | Path, keep_last: int = 0) -> Path:
    """Save model, optimizer, LR schedule and step; every rank calls it. The checkpoint is on
    disk (fsynced) before ``latest`` names it; then, with ``keep_last`` > 0, only the newest
    ``keep_last`` complete checkpoints are kept."""
    root = Path(directory)
    name = f"step_{trainer.step_index:06d}"
    partial = root / f"{name}.partial"
    if _rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    _barrier()
    _, local = _local_state(trainer)
    keys = _disk_keys(trainer, local)
    names = _param_names(keys)
    state = {disk: local[held[0]] for disk, held in keys.items()}
    fused = _fused_rows(trainer)
    for key, value in state.items():
        param = _fused_key(key, fused)
        if param is not None:
            dim, order = fused[param]
            state[key] = _reorder(value, dim, torch.argsort(order))  # back to the model's
    with warnings.catch_warnings():  # one process: "assuming ... a single process", it is one
        if not dist.is_initialized():
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.save(state, checkpoint_id=str(partial))
    _barrier()
    if _rank() == 0:
        # the schedule is a function of the step (autopar.train.optim.lr_at); its horizon
        # goes on with a resumed run
        meta = {"step": trainer.step_index,
                "schedule": {"horizon": trainer.horizon, **trainer.hyper.as_dict()},
                "seed": trainer.seed, "param_names": names, "layout": LAYOUT,
                # the --init-from folder (absolute) or None: what an export names as the base
                "init_from": getattr(trainer, "init_from", None)}
        if getattr(trainer, "scaler", None) is not None:  # fp16's loss scale goes on
            meta["loss_scale"] = trainer.scaler.state_dict()
        (partial / "meta.json").write_text(json.dumps(meta))
        for path in partial.rglob("*"):  # DCP syncs its own files; meta.json and the dirs
            if path.is_file():
                fsync_file(path)
        fsync_dir(partial)
        final = root / name
        aside = root / f"{name}{REPLACED}"
        if final.exists():
            # a checkpoint of the same step (an --overwrite run): moved aside in one rename, not
            # removed, as ``latest`` may name it; until the new one is in place
            # latest_checkpoint finds it there
            shutil.rmtree(aside, ignore_errors=True)
            os.replace(final, aside)
        os.replace(partial, final)
        fsync_dir(root)
        tmp = root / "latest.tmp"
        tmp.write_text(name)
        fsync_file(tmp)
        os.replace(tmp, root / "latest")
        fsync_dir(root)
        shutil.rmtree(aside, ignore_errors=True)
        if keep_last > 0:
            prune_checkpoints(root, keep_last)
    _barrier()
    return root / name


def prune_checkpoints(root: Path, keep_last: int) -> list[Path]:
    """Remove all but the newest ``keep_last`` complete checkpoints in ``root`` (never the one
    ``latest`` names, never anything that is not a ``step_NNNNNN`` directory); returns what
    was removed. Newest by when they were completed, not by step: after ``--overwrite`` the
    new run's early steps are newer than the earlier run's later ones."""
    latest = latest_checkpoint(root)
    complete = sorted((p for p in root.glob("step_*")
                       if p.is_dir() and p.name[5:].isdigit() and (p / "meta.json").is_file()),
                      key=lambda p: ((p / "meta.json").stat().st_mtime_ns, p.name))
    removed = [p for p in complete[:-keep_last] if p != latest]
    for path in removed:
        # unmarked complete first: a removal cut short must not leave a "complete" checkpoint
        (path / "meta.json").unlink(missing_ok=True)
        fsync_dir(path)
        shutil.rmtree(path, ignore_errors=True)
    return removed


def latest_checkpoint(directory: str | Path) -> Path | None:
    """The last complete checkpoint in ``directory``, or None."""
    root = Path(directory)
    pointer = root / "latest"
    if not pointer.is_file():
        return None
    path = root / pointer.read_text().strip()
    if (path / "meta.json").is_file():
        return path
    # a save of the same step was cut short between moving the old one aside and renaming
    # the new one in: the old one is whole where it was moved
    aside = path.with_name(path.name + REPLACED)
    return aside if (aside / "meta.json").is_file() else None


def artifact_checkpoint(directory: str | Path) -> Path:
    """The latest complete checkpoint of artifact ``directory`` (in DIR/checkpoints); refused
    in one line when its training has saved none."""
    ckpt = latest_checkpoint(Path(directory) / "checkpoints")
    if ckpt is None:
        raise PlanError(f"no complete checkpoint in {Path(directory) / 'checkpoints'}; train "
                        f"first (autopar run {directory} --steps N saves one at the end)")
    return ckpt


def read_tensors(ckpt: Path, stored: dict, names: list[str]) -> dict[str, torch.Tensor]:
    """The named model tensors of a distributed checkpoint, whole (no process group)."""
    state = {f"model.{n}": torch.empty(tuple(stored[f"model.{n}"].size),
                                       dtype=stored[f"model.{n}"].properties.dtype)
             for n in names}
    with warnings.catch_warnings():  # "assuming ... a single process": it is one
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=str(ckpt), no_dist=True)
    return state


def load_checkpoint(trainer: Trainer, directory: str | Path) -> int:
    """Load the latest checkpoint into ``trainer`` (resharding to its plan); returns its step.

    A checkpoint of another model is refused before anything is changed.
    """
    path = latest_checkpoint(directory)
    if path is None:
        raise PlanError(f"no complete checkpoint in {directory}; train without --resume first")
    meta = json.loads((path / "meta.json").read_text())
    layout = meta.get("layout", 1)
    if layout == 1 and (trainer.pipe is not None or _zero1(trainer) is not None):
        raise PlanError(f"checkpoint {path} predates pipeline/ZeRO-1 checkpoints; resume it "
                        f"under a plan with pp=1 and zero_stage != 1 first")
    options = _FLAT if layout == LAYOUT else StateDictOptions()
    optim, local = _local_state(trainer, options)
    keys = _disk_keys(trainer, local) if layout == LAYOUT else {k: [k] for k in local}
    mine, theirs = _param_names(keys), meta["param_names"]
    if mine != theirs:
        missing = sorted(set(theirs) ^ set(mine))[:3]
        raise PlanError(f"checkpoint {path} is of another model (parameters differ, e.g. "
                        f"{missing}); resume with the model it was saved from")
    if layout == 1:
        state = dict(zip(("model", "optim"), _split(local), strict=True))
        dcp.load(state, checkpoint_id=str(path))
        model_sd, optim_sd = state["model"], state["optim"]
    else:
        disk = {key: local[held[0]] for key, held in keys.items()}
        fused = _fused_rows(trainer)
        stored = {}  # fused parameters (and their states) arrive in the model's own order
        for key in disk:
            name = _fused_key(key, fused)
            if name is not None and _reorderable(disk[key], *fused[name]):
                stored[key] = disk[key] = torch.empty_like(disk[key])
        dcp.load(disk, checkpoint_id=str(path))  # tensors in place, other values replaced
        for key, buffer in stored.items():
            disk[key] = _reorder(buffer, *fused[_fused_key(key, fused)])
        for key, held in keys.items():
            for name in held:  # every copy of a tied parameter gets the canonical value
                value = local[name]
                if not isinstance(value, torch.Tensor):
                    local[name] = disk[key]
                elif value is not disk[key]:
                    value.copy_(disk[key])
        model_sd, optim_sd = _split(local)
    with _without_empty_groups(optim):
        set_state_dict(trainer.model, optim, model_state_dict=model_sd,
                       optim_state_dict=optim_sd, options=options)
    zero = _zero1(trainer)
    if zero is not None:  # the loaded learning rates belong on the wrapper the schedule drives
        _copy_hyperparameters(zero.optim.param_groups, zero.param_groups)
    if trainer.hyper.decay_steps is None:  # a horizon set for this run wins
        trainer.horizon = meta.get("schedule", {}).get("horizon")
    if getattr(trainer, "scaler", None) is not None and "loss_scale" in meta:
        trainer.scaler.load_state_dict(meta["loss_scale"])
    if getattr(trainer, "init_from", None) is None:  # a resumed run started where this one did
        trainer.init_from = meta.get("init_from")
    trainer.step_index = int(meta["step"])
    torch.manual_seed(trainer.seed + trainer.step_index)
    return trainer.step_index
