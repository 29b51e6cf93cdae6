"""Distributed checkpoints (torch.distributed.checkpoint) that load under any plan.

Layout: CKPT_DIR/step_000004/ (DCP files + meta.json) and CKPT_DIR/latest (the name of the
last complete one). A checkpoint is written to step_N.partial and renamed only after every
rank has finished, and `latest` is replaced atomically after that: a half-written checkpoint
never shadows the last good one.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from autopar.errors import PlanError


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def save_checkpoint(trainer, directory: str | Path) -> Path:
    """Save model, optimizer, LR schedule and step; every rank calls it."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    if getattr(trainer, "pipe", None) is not None:
        raise PlanError("checkpoints of pipeline-parallel runs are not supported yet; plan "
                        "with pp=1 to checkpoint")
    if isinstance(trainer.optimizer, ZeroRedundancyOptimizer):
        raise PlanError("checkpoints of ZeRO-1 (ZeroRedundancyOptimizer) runs are not supported "
                        "yet; plan with zero_stage 0, 2 or 3")
    root = Path(directory)
    name = f"step_{trainer.step_index:06d}"
    partial = root / f"{name}.partial"
    if _rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    _barrier()
    model_sd, optim_sd = get_state_dict(trainer.model, trainer.optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(partial))
    _barrier()
    if _rank() == 0:
        meta = {"step": trainer.step_index, "schedule": trainer.schedule.state_dict(),
                "seed": trainer.seed, "param_names": sorted(model_sd)}
        (partial / "meta.json").write_text(json.dumps(meta))
        final = root / name
        shutil.rmtree(final, ignore_errors=True)
        os.replace(partial, final)
        tmp = root / "latest.tmp"
        tmp.write_text(name)
        os.replace(tmp, root / "latest")
    _barrier()
    return root / name


def latest_checkpoint(directory: str | Path) -> Path | None:
    root = Path(directory)
    pointer = root / "latest"
    if not pointer.is_file():
        return None
    path = root / pointer.read_text().strip()
    return path if (path / "meta.json").is_file() else None


def load_checkpoint(trainer, directory: str | Path) -> int:
    """Load the latest checkpoint into ``trainer`` (resharding to its plan); returns its step.

    A checkpoint of another model is refused before anything is changed.
    """
    path = latest_checkpoint(directory)
    if path is None:
        raise PlanError(f"no complete checkpoint in {directory}; train without --resume first")
    meta = json.loads((path / "meta.json").read_text())
    model_sd, optim_sd = get_state_dict(trainer.model, trainer.optimizer)
    mine, theirs = sorted(model_sd), meta["param_names"]
    if mine != theirs:
        missing = sorted(set(theirs) ^ set(mine))[:3]
        raise PlanError(f"checkpoint {path} is of another model (parameters differ, e.g. "
                        f"{missing}); resume with the model it was saved from")
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(trainer.model, trainer.optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    trainer.schedule.load_state_dict(meta["schedule"])
    trainer.step_index = int(meta["step"])
    torch.manual_seed(trainer.seed + trainer.step_index)
    return trainer.step_index
