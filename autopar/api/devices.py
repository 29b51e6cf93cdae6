"""Where a front-door run is: how many processes, this one's rank, its device type, and the
device profile to plan for."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from autopar.api.arguments import TrainingArguments


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
    """The device profile a run on this machine is planned for: cpu, or the accelerator's
    by its name (a100-80g when the name is not one autopar has a profile of)."""
    if kind == "cpu":
        return "cpu"
    name = torch.cuda.get_device_name().lower() if kind == "cuda" else ""
    memory_gb = torch.cuda.get_device_properties(0).total_memory / 2**30 if kind == "cuda" \
        else 0
    for key, profile in (("h200", "h200"), ("h100", "h100-80g"), ("b200", "b200"),
                         ("v100", "v100-16g")):
        if key in name:
            return profile
    if "a100" in name:
        return "a100-40g" if memory_gb < 60 else "a100-80g"
    return "ascend-910b" if kind == "npu" else "a100-80g"
