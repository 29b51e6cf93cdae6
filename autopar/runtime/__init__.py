"""Runtime: run a Plan with PyTorch's distributed engine (DTensor, fully_shard, DDP)."""

from autopar.runtime.trainer import Trainer

__all__ = ["Trainer"]
