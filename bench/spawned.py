"""What the multi-process benches share: spawning gloo ranks and reading back rank 0's result,
and reading a process's memory figures."""

from __future__ import annotations

import queue
import resource
from pathlib import Path

import torch.multiprocessing as mp


def rank0_result(target, world: int, args: tuple, timeout_s: float = 900.0) -> object:
    """Run ``target(rank, port, *args, out)`` on ``world`` spawned processes and return the
    payload rank 0 puts on ``out`` as ("ok", payload); ("error", text) from any rank, or no
    result in ``timeout_s``, raises RuntimeError. The processes are always reaped."""
    from autopar.calibrate.profile_comm import free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, port, *args, out), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        status, payload = out.get(timeout=timeout_s)
    except queue.Empty:
        status, payload = "error", f"no result in {timeout_s:.0f} s"
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    if status != "ok":
        raise RuntimeError(payload)
    return payload


def status_bytes(field: str) -> int:
    """A byte figure of this process from /proc/self/status: ``VmRSS`` (resident now) or
    ``VmHWM`` (its high-water mark). Not ru_maxrss: Linux carries that across exec, so a
    spawned child would report its parent's peak at fork time."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    if field == "VmHWM":
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")
