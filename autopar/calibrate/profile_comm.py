"""Collective benchmarks for ``autopar profile``: local processes, timed collectives, alpha-beta fits.

``measure_collectives(nprocs, backend)`` starts ``nprocs`` processes (start method spawn) that
join one torch.distributed group on 127.0.0.1 (gloo on CPU, nccl on GPU, one GPU per rank),
time each collective over a sweep of message sizes and return, per collective, the measured
points and a fitted latency ``alpha`` (s) and bandwidth ``beta`` (bytes/s) of the ring model:

==============  ==========================================  =============================
collective      time                                        ``bytes``
==============  ==========================================  =============================
all_reduce      2(n-1) alpha + 2(n-1)/n bytes/beta           the reduced tensor
all_gather      (n-1) alpha + (n-1)/n bytes/beta             the full (gathered) output
reduce_scatter  (n-1) alpha + (n-1)/n bytes/beta             the full (unscattered) input
all_to_all      (n-1) alpha + (n-1)/n bytes/beta             one rank's whole tensor
broadcast       alpha + bytes/beta                           the tensor
send_recv       alpha + bytes/beta                           the message (ping-pong / 2)
==============  ==========================================  =============================

``beta`` is therefore the bus bandwidth (per device, one direction) in nccl-tests' sense.
A measured time is the median over repeats of the slowest rank's time.
"""

from __future__ import annotations

import os
import queue
import socket
import statistics
import time
import traceback
import warnings
from datetime import timedelta

from autopar.errors import AutoparError

INIT_TIMEOUT_S = 60.0
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send_recv")


def model_coefficients(name: str, n: int) -> tuple[float, float]:
    """(alpha coefficient, bytes/beta coefficient) of collective ``name`` on ``n`` ranks."""
    if name == "all_reduce":
        return 2.0 * (n - 1), 2.0 * (n - 1) / n
    if name in ("all_gather", "reduce_scatter", "all_to_all"):
        return float(n - 1), (n - 1) / n
    return 1.0, 1.0


def predict(fit: dict, nbytes: float, n: int) -> float:
    """Seconds the fitted model gives for ``nbytes`` on ``n`` ranks."""
    ca, cb = model_coefficients(fit["collective"], n)
    return ca * fit["alpha"] + cb * nbytes / fit["beta"]


def fit_alpha_beta(name: str, n: int, points: list[tuple[float, float]]) -> dict:
    """Least-squares ``alpha``, ``beta`` from ``[(bytes, seconds), ...]``.

    Residuals are relative (each weighted by 1/time) so that the small messages fix the latency
    and the large ones the bandwidth; both are kept positive (a two-variable NNLS). Points the
    first fit misses by more than 2x (a descheduled rank, a protocol switch) are dropped once
    and the fit redone, as long as three points remain.
    """
    fit = _fit(name, n, points)
    kept = [(b, t) for b, t in points if 0.5 <= predict(fit, b, n) / t <= 2.0]
    if 3 <= len(kept) < len(points):
        fit = _fit(name, n, kept)
    fit["points"] = [[int(b), float(t)] for b, t in points]
    fit["outliers"] = len(points) - len(kept) if len(kept) >= 3 else 0
    return fit


def _fit(name: str, n: int, points: list[tuple[float, float]]) -> dict:
    ca, cb = model_coefficients(name, n)
    rows = [(ca / t, cb * b / t) for b, t in points]  # unknowns: alpha, x = 1/beta; target 1
    s11 = sum(r[0] * r[0] for r in rows)
    s12 = sum(r[0] * r[1] for r in rows)
    s22 = sum(r[1] * r[1] for r in rows)
    y1 = sum(r[0] for r in rows)
    y2 = sum(r[1] for r in rows)
    det = s11 * s22 - s12 * s12
    alpha, x = ((s22 * y1 - s12 * y2) / det, (s11 * y2 - s12 * y1) / det) if det > 0 else (-1, -1)
    if alpha <= 0 or x <= 0:  # the optimum lies on a bound: keep the better one-variable fit
        candidates = [(y1 / s11, 0.0), (0.0, y2 / s22)]
        alpha, x = min(candidates, key=lambda c: sum((c[0] * r[0] + c[1] * r[1] - 1) ** 2
                                                     for r in rows))
    smallest = min(t for _, t in points)
    alpha = alpha if alpha > 0 else smallest / ca / 10  # latency lost in noise: a bound below
    beta = 1.0 / x if x > 0 else max(b / t for b, t in points) * cb  # bandwidth never limited
    return {"collective": name, "alpha": alpha, "beta": beta}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ops(dist, torch, name: str, numel: int, n: int, rank: int, device):
    """A zero-argument callable running collective ``name`` once on ``numel`` floats, and the
    ``bytes`` it is charged with (see the module docstring)."""
    f32 = torch.float32
    numel = max(n, numel // n * n)  # divisible by the group size
    size = numel * 4
    x = torch.ones(numel, dtype=f32, device=device)
    if name == "all_reduce":
        return (lambda: dist.all_reduce(x)), size
    if name == "all_gather":
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        shard, out = x[: numel // n], torch.empty(numel, dtype=f32, device=device)
        return (lambda: gather(out, shard)), size
    if name == "reduce_scatter":
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        out = torch.empty(numel // n, dtype=f32, device=device)
        return (lambda: scatter(out, x)), size
    if name == "all_to_all":
        out = torch.empty_like(x)
        return (lambda: dist.all_to_all_single(out, x)), size
    if name == "broadcast":
        return (lambda: dist.broadcast(x, 0)), size

    def ping_pong() -> None:  # ranks 0 and 1; the others wait at the next barrier
        if rank == 0:
            dist.send(x, 1)
            dist.recv(x, 1)
        elif rank == 1:
            dist.recv(x, 0)
            dist.send(x, 0)

    return ping_pong, size


def _worker(rank: int, n: int, port: int, backend: str, sizes: list[int], repeats: int,
            threads: int, results) -> None:
    """One rank: join the group, time every (collective, size), rank 0 reports."""
    try:
        import torch
        import torch.distributed as dist

        warnings.filterwarnings("ignore", category=FutureWarning)
        torch.set_num_threads(threads)
        device = torch.device("cpu")
        if backend == "nccl":
            device = torch.device("cuda", rank)
            torch.cuda.set_device(device)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=n, timeout=timedelta(seconds=INIT_TIMEOUT_S))
        sync = torch.cuda.synchronize if backend == "nccl" else (lambda: None)
        points: dict[str, list[tuple[float, float]]] = {}
        for name in COLLECTIVES:  # sizes interleaved round by round: a slow spell of the
            ops = [_ops(dist, torch, name, b // 4, n, rank, device) for b in sizes]  # machine
            rounds = [repeats * 3 if b <= 1 << 20 else repeats for b in sizes]  # hits them all
            for fn, _ in ops:
                for _ in range(2):  # warm-up: connections, buffers, algorithm choice
                    fn()
            sync()
            times: list[list[float]] = [[] for _ in sizes]
            for r in range(max(rounds)):
                for i, (fn, _) in enumerate(ops):
                    if r >= rounds[i]:
                        continue
                    dist.barrier()
                    sync()
                    start = time.perf_counter()
                    fn()
                    sync()
                    times[i].append(time.perf_counter() - start)
            flat = torch.tensor([t for ts in times for t in ts], dtype=torch.float64,
                                device=device)
            dist.all_reduce(flat, op=dist.ReduceOp.MAX)  # the slowest rank's time
            flat_list, at = flat.cpu().tolist(), 0
            points[name] = []
            for (_, charged), count in zip(ops, rounds, strict=True):
                median = statistics.median(flat_list[at:at + count])
                at += count
                if name == "send_recv":
                    median /= 2  # one way of the round trip
                points[name].append((float(charged), median))
            del ops
        overlap = _measure_overlap(dist, torch, device, sync)
        dist.barrier()
        if rank == 0:
            results.put(("ok", {**points, "_overlap": overlap}))
        dist.destroy_process_group()
    except Exception as exc:  # reported to the parent as one line
        last = traceback.format_exception_only(type(exc), exc)[-1].strip()
        results.put(("error", f"rank {rank}: {last}"))


def _measure_overlap(dist, torch, device, sync, repeats: int = 5) -> tuple[float, float]:
    """(concurrent, compute_slowdown) of communication beside compute on this machine.

    ``compute_slowdown``: a short burst of matmuls timed while a longer all_reduce is in
    flight, over the same burst alone, minus one. ``concurrent``: from a 16 MB all_reduce run
    beside the burst, the share of the collective that ran concurrently, solving the cost
    model's ``both = compute + comm - (1 - slowdown) x min(concurrent x comm, compute)``.
    Near 1 and a small slowdown where the two run on separate engines (GPU SMs vs NCCL's);
    lower where they share cores (CPU with gloo).
    """
    a = torch.randn(512, 512, device=device)
    buf = torch.ones(4 << 20, device=device)  # 16 MB fp32
    big = torch.ones(32 << 20, device=device)  # 128 MB fp32: outlasts the burst

    def compute() -> None:
        for _ in range(8):
            a @ a

    def timed(fn) -> float:
        times = []
        for _ in range(repeats):
            dist.barrier()
            sync()
            start = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    def both() -> None:
        work = dist.all_reduce(buf, async_op=True)
        compute()
        work.wait()

    def under() -> float:
        dist.barrier()
        sync()
        work = dist.all_reduce(big, async_op=True)
        start = time.perf_counter()
        compute()
        sync()
        seconds = time.perf_counter() - start
        work.wait()
        return seconds

    compute()
    t_compute = timed(compute)
    t_comm = timed(lambda: dist.all_reduce(buf))
    t_both = timed(both)
    t_under = statistics.median(under() for _ in range(repeats))
    slowdown = min(max(t_under / max(t_compute, 1e-9) - 1.0, 0.0), 4.0)
    hidden = (t_compute + t_comm - t_both) / max((1 - min(slowdown, 0.99)) * t_comm, 1e-9)
    verdict = torch.tensor([min(1.0, max(0.0, hidden)), slowdown], dtype=torch.float64,
                           device=device)
    gathered = [torch.zeros_like(verdict) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, verdict)
    concurrent = min(float(v[0]) for v in gathered)
    worst_slowdown = max(float(v[1]) for v in gathered)
    return concurrent, worst_slowdown


def check_nprocs(nprocs: int, backend: str) -> None:
    """nccl runs one process per GPU: refuse more processes than GPUs, naming the fix."""
    import torch

    gpus = torch.cuda.device_count()
    if backend == "nccl" and nprocs > gpus:
        fix = f"use --nprocs {gpus}" if gpus > 1 else "use --nprocs 1 (no collectives)"
        raise AutoparError(f"--nprocs {nprocs} needs {nprocs} GPUs for nccl (one per process); "
                           f"torch sees {gpus}: {fix}")


def measure_collectives(nprocs: int, backend: str, sizes: list[int] | None = None,
                        repeats: int = 5, timeout_s: float = 240.0
                        ) -> tuple[dict[str, dict], tuple[float, float]]:
    """Time the collectives on ``nprocs`` local ranks and fit alpha-beta per collective.

    Returns ``({collective: {"collective", "alpha", "beta", "points": [[bytes, s], ...]}},
    (concurrent, compute_slowdown))``: the measured overlap of communication and compute.
    Raises AutoparError if a rank fails or the whole run exceeds ``timeout_s``; every child
    process is gone when this returns or raises.
    """
    import torch.multiprocessing as mp

    if nprocs < 2:
        raise AutoparError(f"collectives need at least 2 processes, got --nprocs {nprocs}")
    check_nprocs(nprocs, backend)
    sizes = sizes or [4 << 10 << 2 * i for i in range(8)]  # 4 KB .. 64 MB
    threads = max(1, (os.cpu_count() or 1) // nprocs)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, daemon=True,
                         args=(rank, nprocs, port, backend, sizes, repeats, threads, results))
             for rank in range(nprocs)]
    deadline = time.monotonic() + timeout_s
    try:
        for proc in procs:
            proc.start()
        while True:
            try:
                status, payload = results.get(timeout=1.0)
                break
            except queue.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise AutoparError(f"collective benchmark: a rank exited with code "
                                       f"{dead[0].exitcode} before reporting") from None
                if time.monotonic() > deadline:
                    raise AutoparError(f"collective benchmark did not finish in {timeout_s:.0f} "
                                       f"s ({backend}, {nprocs} ranks); try --quick or fewer "
                                       f"--nprocs") from None
        if status != "ok":
            raise AutoparError(f"collective benchmark failed ({backend}): {payload}")
        for proc in procs:
            proc.join(timeout=max(1.0, min(30.0, deadline - time.monotonic())))
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        results.close()
        results.join_thread()
    overlap = payload.pop("_overlap")
    fits = {name: fit_alpha_beta(name, nprocs, [tuple(p) for p in pts])
            for name, pts in payload.items()}
    return fits, overlap
