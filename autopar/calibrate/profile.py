"""``autopar profile``: measure this machine and write a hardware catalog entry for it.

The result is a mapping in the catalog format of :mod:`autopar.cost.hardware` (so
``load_cluster(path)`` reads the written file, and ``cluster=PATH`` uses it) plus extra
top-level keys the loader ignores: ``collectives`` (per-collective alpha-beta fits and their
points), ``measurements`` (the raw sweeps) and ``profile`` (how it was measured).

Convention on a profiled machine: ``peak_flops[dtype]`` is the best rate measured over the
matmul sweep and ``memory_bandwidth`` the best measured copy/add bandwidth, so
``efficiency.matmul`` and ``efficiency.memory`` are 1.0; ``kernel_overhead_s`` is a tiny op's
time issued back to back; ``efficiency.attention`` is a measured
scaled_dot_product_attention rate over the peak of its dtype (fp32 on CPU, bf16 on GPU); the
``overlap`` figures come from matmuls run beside all_reduces (see
:func:`autopar.calibrate.profile_comm.measure_collectives`).

On CPU one "device" is one of ``nprocs`` processes sharing the machine, as the gloo runtime runs
them: compute is measured with ``cpu_count // nprocs`` threads (and scaled by cores / nprocs when
there are more processes than cores), the memory bandwidth measured with
all threads is divided by ``nprocs``, and ``memory_bytes`` is the RAM divided by ``nprocs``.
"""

from __future__ import annotations

import contextlib
import math
import os
import platform
import shlex
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from pathlib import Path

import torch
import yaml

from autopar.calibrate.profile_comm import check_nprocs, measure_collectives
from autopar.errors import AutoparError

DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16,
          "fp16": torch.float16}


def _sync(device: torch.device) -> Callable[[], None]:
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def time_call(fn: Callable[[], object], device: torch.device, repeats: int,
              min_sample_s: float = 2e-3) -> float:
    """Median seconds per call of ``fn`` after warm-up; a sample batches enough calls to
    last ``min_sample_s`` so that short calls are not lost in timer overhead."""
    sync = _sync(device)
    fn()
    sync()
    start = time.perf_counter()
    fn()
    sync()
    once = max(time.perf_counter() - start, 1e-7)
    inner = max(1, min(10_000, int(min_sample_s / once)))
    samples = []
    for _ in range(max(1, repeats)):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        sync()
        samples.append((time.perf_counter() - start) / inner)
    return statistics.median(samples)


@contextlib.contextmanager
def _setting(get: Callable[[], object], put: Callable[[object], None],
             value: object) -> Iterator[None]:
    """``put(value)`` for the block, the old value back after (``value`` None: unchanged)."""
    before = get()
    if value is not None:
        put(value)
    try:
        yield
    finally:
        put(before)


def _threads(count: int | None) -> contextlib.AbstractContextManager:
    return _setting(torch.get_num_threads, torch.set_num_threads, count)


def _tf32(enabled: bool) -> contextlib.AbstractContextManager:
    matmul = torch.backends.cuda.matmul
    return _setting(lambda: matmul.allow_tf32, lambda v: setattr(matmul, "allow_tf32", v),
                    enabled)


def matmul_shapes(sizes: list[int]) -> list[tuple[str, int, int, int]]:
    """(kind, m, k, n): square d x d x d, and skinny (few rows, m = the smallest size) per d."""
    small = min(sizes)
    shapes = [("square", d, d, d) for d in sizes]
    return shapes + [("skinny", small, d, d) for d in sizes if d > small]


def measure_matmul(device: torch.device | str, dtypes: list[str], sizes: list[int],
                   repeats: int) -> dict[str, list[dict]]:
    """torch.mm rate per dtype and shape: ``{dtype: [{kind, m, k, n, seconds, flops}, ...]}``
    where ``flops`` is the achieved FLOP/s (2 m k n / median seconds)."""
    device = torch.device(device)
    out: dict[str, list[dict]] = {}
    for name in dtypes:
        dtype = DTYPES[name]
        rows = []
        with _tf32(name == "tf32") if device.type == "cuda" else contextlib.nullcontext():
            for kind, m, k, n in matmul_shapes(sizes):
                a = torch.randn(m, k, device=device).to(dtype)
                b = torch.randn(k, n, device=device).to(dtype)
                seconds = time_call(lambda a=a, b=b: torch.mm(a, b), device, repeats)
                rows.append({"kind": kind, "m": m, "k": k, "n": n, "seconds": seconds,
                             "flops": 2.0 * m * k * n / seconds})
        out[name] = rows
    return out


def tensor_core_dtypes(device: torch.device) -> list[str]:
    """The dtypes this device's matrix units run, from its CUDA compute capability."""
    if device.type != "cuda":
        return []
    major, _ = torch.cuda.get_device_capability(device)
    if major >= 9:
        return ["tf32", "bf16", "fp16", "fp8"]
    if major >= 8:
        return ["tf32", "bf16", "fp16"]
    return ["fp16"] if major >= 7 else []


def measure_kernel_overhead(device: torch.device, repeats: int) -> float:
    """Seconds of one tiny op issued back to back: the fixed cost of every kernel."""
    x = torch.ones(1, device=device)
    return time_call(lambda: torch.add(x, x), device, repeats)


def measure_memory_bandwidth(device: torch.device | str, nbytes: int = 256 << 20,
                             repeats: int = 5) -> dict[str, float]:
    """Bytes moved per second by a large copy (read + write) and add (2 reads + write)."""
    device = torch.device(device)
    numel = nbytes // 4
    a = torch.ones(numel, device=device)
    b = torch.empty_like(a)
    c = torch.empty_like(a)
    copy_s = time_call(lambda: b.copy_(a), device, repeats)
    add_s = time_call(lambda: torch.add(a, b, out=c), device, repeats)
    return {"bytes": float(numel * 4), "copy": 2 * numel * 4 / copy_s,
            "add": 3 * numel * 4 / add_s}


def measure_host_bandwidth(device: torch.device, nbytes: int, repeats: int) -> dict[str, float]:
    """Host <-> device copy rates (bytes/s), pinned and pageable (GPU only)."""
    dev = torch.empty(nbytes // 4, device=device)
    rates = {}
    for pinned in (True, False):
        host = torch.empty(nbytes // 4, pin_memory=pinned)
        tag = "pinned" if pinned else "pageable"
        rates[f"h2d_{tag}"] = nbytes / time_call(lambda h=host: dev.copy_(h), device, repeats)
        rates[f"d2h_{tag}"] = nbytes / time_call(lambda h=host: h.copy_(dev), device, repeats)
    return rates


def measure_attention(device: torch.device, dtype: torch.dtype, seq: int,
                      repeats: int) -> float:
    """Achieved FLOP/s of non-causal scaled_dot_product_attention (batch 1, 8 heads, dim 64)."""
    q, k, v = (torch.randn(1, 8, seq, 64, device=device, dtype=dtype) for _ in range(3))
    seconds = time_call(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v),
                        device, repeats)
    return 4.0 * 8 * seq * seq * 64 / seconds


def _plan(device: torch.device, quick: bool) -> dict:
    gpu = device.type == "cuda"
    if gpu:
        sizes = [256, 512, 1024, 2048, 4096] + ([] if quick else [8192])
        dtypes = ["fp32", "tf32", "bf16", "fp16"]
        mem = (256 if quick else 1024) << 20
        comm = [4 << 10 << 2 * i for i in range(8)] if quick else \
            [4 << 10 << i for i in range(19)]  # 4 KB .. 64 MB (quick) / 1 GB
    else:
        sizes = [64, 128, 256, 512, 1024] + ([] if quick else [1536, 2048])
        dtypes = ["fp32", "bf16"]
        mem = 256 << 20
        comm = [4 << 10 << (2 if quick else 1) * i for i in range(7 if quick else 15)]
        # 4 KB .. 16 MB in steps of 4x (quick), 4 KB .. 64 MB in steps of 2x
    return {"sizes": sizes, "dtypes": dtypes, "mem_bytes": mem, "comm_sizes": comm,
            "repeats": 3 if quick else 7, "comm_repeats": 7 if quick else 20,
            "attention_seq": 512 if quick or not gpu else 4096}


def profile_machine(nprocs: int = 2, quick: bool = False, device: str | None = None,
                    timeout_s: float = 300.0) -> dict:
    """Measure this machine; returns the catalog mapping (see the module docstring)."""
    import psutil

    if nprocs < 1:
        raise AutoparError(f"--nprocs must be at least 1, got {nprocs}")
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type not in ("cpu", "cuda"):
        raise AutoparError(f"cannot profile device type '{dev.type}': use cpu or cuda")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise AutoparError("--device cuda asked for but torch sees no CUDA device")
    gpu = dev.type == "cuda"
    if gpu and dev.index is None:
        dev = torch.device("cuda", 0)
    backend = "nccl" if gpu else "gloo"
    check_nprocs(nprocs, backend)  # before minutes of measuring
    plan = _plan(dev, quick)
    cpus = os.cpu_count() or 1
    threads = None if gpu else max(1, cpus // nprocs)
    started = time.perf_counter()
    with _threads(threads):
        mm = measure_matmul(dev, plan["dtypes"], plan["sizes"], plan["repeats"])
        if not gpu:  # CPU fp16 is emulated and slow; record it so plans do not assume fp32's
            mm |= measure_matmul(dev, ["fp16"], [d for d in plan["sizes"] if d <= 256],
                                 plan["repeats"])
        attn_dtype = "bf16" if gpu else "fp32"  # the dtype a GPU trains attention in
        attn = measure_attention(dev, DTYPES[attn_dtype], plan["attention_seq"], plan["repeats"])
    mem = measure_memory_bandwidth(dev, plan["mem_bytes"], 3 * plan["repeats"])
    # more processes than cores: each process gets cpus/nprocs of a core while all compute
    core_share = 1.0 if gpu or nprocs <= cpus else cpus / nprocs
    peak = {name: max(r["flops"] for r in rows) * core_share for name, rows in mm.items()}
    overhead = measure_kernel_overhead(dev, plan["repeats"])
    share = 1 if gpu else nprocs
    bandwidth = max(mem["copy"], mem["add"]) / share
    host_rates = measure_host_bandwidth(dev, plan["mem_bytes"], plan["repeats"]) if gpu else {}
    host_bw = min(host_rates["h2d_pinned"], host_rates["d2h_pinned"]) if gpu else bandwidth
    # the host DRAM an offloaded optimizer step runs on: all of the node's processes share it
    host_mem = measure_memory_bandwidth(torch.device("cpu"), plan["mem_bytes"],
                                        plan["repeats"]) if gpu else mem
    host_memory_bandwidth = max(host_mem["copy"], host_mem["add"])
    ram = float(psutil.virtual_memory().total)
    memory_bytes = float(torch.cuda.get_device_properties(dev).total_memory) if gpu else ram / nprocs

    fits: dict[str, dict] = {}
    concurrent, slowdown = (1.0, 0.0)
    overlap_src = "not measured (--nprocs 1): nothing to exchange with"
    if nprocs >= 2:
        left = timeout_s - (time.perf_counter() - started)
        fits, (concurrent, slowdown) = measure_collectives(
            nprocs, backend, plan["comm_sizes"], plan["comm_repeats"], timeout_s=max(60.0, left))
        intra_bw, intra_lat = fits["all_reduce"]["beta"], fits["all_reduce"]["alpha"]
        comm_src = f"all_reduce alpha-beta fit over {nprocs} {backend} ranks (bus bandwidth)"
        overlap_src = ("matmuls timed beside a 128 MB all_reduce (slowdown) and a 16 MB "
                       "all_reduce run beside them (concurrent share)")
    else:  # nothing to exchange with: the host path stands in, the latency is the default
        intra_bw, intra_lat = host_bw, 1e-5
        comm_src = "not measured (--nprocs 1): host_bandwidth and a 10 us default"

    name = torch.cuda.get_device_name(dev) if gpu else _cpu_model()
    slug = "-".join(name.lower().replace("(r)", "").split())[:40]
    return {
        "name": f"profile-{socket.gethostname()}-{slug}",
        "device": {
            "type": dev.type,
            "backend": backend,
            "peak_flops": peak,
            "tensor_core_dtypes": tensor_core_dtypes(dev),
            "compute_units": (torch.cuda.get_device_properties(dev).multi_processor_count
                              if gpu else 1),
            "matmul_tile": [256, 128] if gpu else [1, 1],
            "kernel_overhead_s": overhead,
            "memory_bytes": memory_bytes,
            "usable_fraction": 0.9,
            "allocator_fragmentation": 0.08 if gpu else 0.0,
            "memory_bandwidth": bandwidth,
            "efficiency": {"matmul": 1.0, "memory": 1.0,
                           "attention": min(1.0, attn / peak[attn_dtype])},
            "overlap": {"concurrent": round(concurrent, 3),
                        "compute_slowdown": round(slowdown, 3)},
        },
        "node": {
            "devices_per_node": torch.cuda.device_count() if gpu else nprocs,
            "compute_slots": torch.cuda.device_count() if gpu else min(nprocs, cpus),
            "intra_bandwidth": intra_bw,
            "intra_efficiency": 1.0,
            "intra_latency": intra_lat,
            "inter_bandwidth": intra_bw,
            "inter_efficiency": 1.0,
            "inter_latency": intra_lat,
            "collective_latency": intra_lat,
            "host_bandwidth": host_bw,
            "host_memory_bytes": ram,
            "host_cores": cpus,
            "host_memory_bandwidth": host_memory_bandwidth,
        },
        "sources": {
            "peak_flops": "best torch.mm rate of the sweep (efficiency.matmul = 1.0)"
                          + ("" if gpu else f", {threads} thread(s) per process; fp16 up to "
                             "256^3 only")
                          + (f"; x {core_share:.2f}: {nprocs} processes share {cpus} cores"
                             if core_share < 1 else ""),
            "tensor_core_dtypes": "CUDA compute capability (7.x fp16; 8.x tf32, bf16, fp16; "
                                  "9.x and up also fp8); none on a CPU",
            "compute_units": "cuda multi_processor_count" if gpu else "one core per process",
            "matmul_tile": "the typical cuBLAS tile (not measured)" if gpu else "no tiles",
            "kernel_overhead_s": "median time of a one-element add, issued back to back",
            "memory_bandwidth": "best of copy / add over a large tensor (efficiency.memory = 1.0)"
                                + ("" if gpu else f", divided among {nprocs} processes"),
            "attention": f"sdpa {attn_dtype} rate / peak_flops.{attn_dtype}",
            "overlap": overlap_src,
            "memory_bytes": "cuda total_memory" if gpu else f"RAM / {nprocs} processes",
            "compute_slots": "one GPU per device" if gpu else
                             f"{cpus} cores for {nprocs} single-threaded processes",
            "usable_fraction": "default, not measured",
            "allocator_fragmentation": "not measured: the shipped catalogs' figure for PyTorch's "
                                       "caching allocator (meta-llama/llama-cookbook#120)" if gpu
                                       else "not measured: CPU tensors keep no caching pool",
            "host_cores": "os.cpu_count()",
            "host_memory_bandwidth": "best of copy / add over a large CPU tensor, all threads",
            "intra_bandwidth": comm_src + "; achieved, so intra_efficiency = 1.0",
            "intra_latency": comm_src, "collective_latency": comm_src,
            "inter_bandwidth": "single-node profile: inter_* copy the intra-node fit",
            "inter_latency": "single-node profile: inter_* copy the intra-node fit",
            "host_bandwidth": "min of pinned h2d / d2h copies" if gpu else "memory_bandwidth",
        },
        "collectives": {k: {"alpha": v["alpha"], "beta": v["beta"], "model": _MODELS[k],
                            "outliers": v["outliers"], "points": v["points"]}
                        for k, v in fits.items()},
        "measurements": {"matmul": mm, "memory": mem, "host_copy": host_rates,
                         "attention_flops": attn},
        "profile": {"nprocs": nprocs, "quick": quick, "threads_per_process": threads,
                    "seconds": round(time.perf_counter() - started, 1),
                    "torch": str(torch.__version__), "host": socket.gethostname()},
    }


_MODELS = {"all_reduce": "2(n-1) alpha + 2(n-1)/n bytes/beta",
           "all_gather": "(n-1) alpha + (n-1)/n bytes/beta, bytes = output",
           "reduce_scatter": "(n-1) alpha + (n-1)/n bytes/beta, bytes = input",
           "all_to_all": "(n-1) alpha + (n-1)/n bytes/beta",
           "broadcast": "ceil(log2 n) alpha + bytes/beta", "send_recv": "alpha + bytes/beta (ping-pong / 2)"}


class _Dumper(yaml.SafeDumper):
    pass


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "cpu"


def _float(dumper: yaml.SafeDumper, value: float) -> yaml.Node:
    if not math.isfinite(value):
        text = ".nan" if math.isnan(value) else (".inf" if value > 0 else "-.inf")
        return dumper.represent_scalar("tag:yaml.org,2002:float", text)
    text = f"{value:.4g}"
    if "." not in text and "e" in text:
        text = text.replace("e", ".0e", 1)  # YAML 1.1 reads 1e-05 as a string
    elif "." not in text:
        text += ".0"
    return dumper.represent_scalar("tag:yaml.org,2002:float", text)


_FlowDict = type("_FlowDict", (dict,), {})
_FlowList = type("_FlowList", (list,), {})


def _styled(obj: object) -> object:
    """Leaves inline (``{fp32: 1.2e+11, bf16: ...}``, ``[4096, 0.00043]``), the rest as blocks."""
    if isinstance(obj, dict):
        if 0 < len(obj) <= 6 and all(isinstance(v, int | float | str) for v in obj.values()):
            return _FlowDict(obj)
        return {k: _styled(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        if all(isinstance(v, int | float) for v in obj):
            return _FlowList(obj)
        return [_styled(v) for v in obj]
    return obj


_Dumper.add_representer(float, _float)
_Dumper.add_representer(_FlowDict, lambda d, v: d.represent_mapping(
    "tag:yaml.org,2002:map", v, flow_style=True))
_Dumper.add_representer(_FlowList, lambda d, v: d.represent_sequence(
    "tag:yaml.org,2002:seq", v, flow_style=True))


def write_profile(data: dict, path: str | Path, command: str | None = None,
                  note: str | None = None) -> Path:
    """Write ``data`` as YAML with a header comment, atomically (temp file + os.replace);
    ``note`` replaces the header's last lines (what the numbers are)."""
    path = Path(path)
    if not path.parent.is_dir():
        raise AutoparError(f"cannot write {path}: folder {path.parent} does not exist")
    command = command or shlex.join(["autopar", *sys.argv[1:]])
    note = note or ("Measured, not datasheet: peak = best measured, so efficiency.matmul/"
                    "memory = 1.\nSingle-node profile: node.inter_* repeat the intra-node "
                    "all_reduce fit.")
    header = (f"# Written by `autopar profile` on {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC\n"
              f"# host: {socket.gethostname()}  torch: {torch.__version__}  "
              f"python: {platform.python_version()}\n"
              f"# command: {command}\n"
              + "".join(f"# {line}\n" for line in note.splitlines()))
    text = header + yaml.dump(_styled(data), Dumper=_Dumper, sort_keys=False,
                              default_flow_style=False, width=100)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        raise AutoparError(f"cannot write {path}: {exc.strerror}") from None
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path
