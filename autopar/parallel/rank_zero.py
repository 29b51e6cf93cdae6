"""Work that one process does for the job (planning, writing the artifact, tokenizing the
data), with its result or its error handed to every rank."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch.distributed as dist

from autopar.errors import AutoparError, PlanError

T = TypeVar("T")


def on_rank_zero(work: Callable[[], T], device: object = None) -> T:
    """``work()`` on rank 0 only; every rank returns its result (picklable). When it fails
    with a user's error, every rank raises it in the same words (the others would otherwise
    wait for a rank that has gone). Without a process group it simply runs. ``device``: where
    the broadcast stages its bytes (the rank's GPU under NCCL; None: the backend's
    default)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return work()
    box: list = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = ("ok", work())
        except AutoparError as exc:
            box[0] = ("error", str(exc))
        except Exception as exc:  # noqa: BLE001 - the others must hear of it too
            box[0] = ("crash", f"{type(exc).__name__}: {exc}")
            dist.broadcast_object_list(box, src=0, device=device)
            raise
    dist.broadcast_object_list(box, src=0, device=device)
    status, value = box[0]
    if status == "ok":
        return value
    raise PlanError(value if status == "error" else f"rank 0 failed ({value})")
