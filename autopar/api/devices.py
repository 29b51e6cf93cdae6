"""Where a front-door run is: how many processes, this one's rank, its device type, and the
device profile to plan for."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from autopar.api.arguments import TrainingArguments
from autopar.serve.pipeline import default_cluster


def world() -> tuple[int, int]:
    """(processes, this one's rank): the process group's when one is joined, else
    torchrun's environment (one process without it)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))


def device_kind(args: TrainingArguments) -> str:
    if args.use_cpu or not torch.accelerator.is_available():
        return "cpu"
    return torch.accelerator.current_accelerator().type


def cluster_for(kind: str) -> str:
    """The device profile a run on this machine is planned for: cpu, or the accelerator's by
    its name (a one-line refusal naming cluster= when autopar has no profile of it)."""
    if kind == "cpu":
        return "cpu"
    return default_cluster(torch.device(kind, int(os.environ.get("LOCAL_RANK", "0"))))
