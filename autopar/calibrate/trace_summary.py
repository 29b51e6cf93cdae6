"""Where a profiled step went, read from one rank's torch.profiler trace (Chrome trace JSON).

The main thread's time inside each ``autopar.step`` is painted, each instant with the most
specific thing running: communication (by collective) > optimizer > backward > forward >
other ops. Time between two ops of the same kind belongs to that kind (Python and dispatch
overhead of that phase); time between different kinds, or with nothing running, is idle: on
a pipeline stage that is its bubble, waiting for a neighbour. Communication counts only where
it holds the main thread (exposed): a collective that runs on its backend's thread while the
main thread computes is overlapped.

Beside the step's terms the summary keeps what recalibration needs: each matmul's shape and
time, each collective's kind, size and time on its backend thread (the wire, not the wait),
and how many ops ran per step.
"""

from __future__ import annotations

import json
import re
import statistics
from collections import defaultdict
from pathlib import Path

STEP = "autopar.step"
FORWARD = "autopar.forward"
BACKWARD = "autopar.backward"
OPTIMIZER = "autopar.optimizer"

_COMM = re.compile(r"^(c10d::|_c10d_functional::|gloo:|nccl:|hccl:)")
_KINDS = (("all_reduce", re.compile(r"all_?reduce")), ("all_gather", re.compile(r"all_?gather")),
          ("reduce_scatter", re.compile(r"reduce_?scatter")),
          ("all_to_all", re.compile(r"all_?to_?all")), ("broadcast", re.compile(r"broadcast")),
          ("send_recv", re.compile(r"send|recv")), ("barrier", re.compile(r"barrier")))
_BACKEND = ("gloo:", "nccl:", "hccl:")
_MATMULS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"}
_DTYPE_BYTES = {"float": 4, "double": 8, "c10::BFloat16": 2, "c10::Half": 2, "long int": 8,
                "int": 4, "bool": 1, "signed char": 1, "unsigned char": 1}
_PRIORITY = {"optimizer": 3, "backward": 2, "forward": 1, "other": 0}  # comm is 4


def collective_kind(name: str) -> str | None:
    """The collective an event runs (``all_reduce``, ``send_recv``, ...), or None."""
    if not _COMM.match(name) or "wrap_tensor" in name:
        return None
    lower = name.lower()
    for kind, pattern in _KINDS:
        if pattern.search(lower):
            return kind
    return "wait" if "wait" in lower else "other_comm"


def collective_axis(kind: str, event: dict, mesh: dict | None = None) -> str:
    """Which mesh axis a collective of autopar's runtime serves, from its kind and its first
    tensor: point-to-point is the pipeline's, all-to-all the experts'; gradient buckets and
    fully_shard's flat parameters are 1-D (data parallel), tensor-parallel activations and
    weights 2-D or more; a few elements are control (the loss, the gradient norm). With the
    plan's ``mesh``, an axis of degree 1 gives way to one that is split (a pipeline's tied
    embedding gradient, a tensor-parallel plan's 1-D partial gradients)."""
    axis = _shape_axis(kind, event)
    if mesh and axis in ("dp", "tp") and mesh.get(axis, 1) <= 1:
        axis = next((a for a in ("dp", "tp", "pp") if mesh.get(a, 1) > 1), axis)
    return axis


def _shape_axis(kind: str, event: dict) -> str:
    if kind == "send_recv":
        return "pp"
    if kind == "all_to_all":
        return "ep"
    if kind == "broadcast":  # ZeRO-1's parameter broadcast, DDP's start-up
        return "dp"
    dims = _first_dims(event)
    numel = 1
    for d in dims:
        numel *= int(d)
    if numel <= 8:
        return "control"
    return "tp" if len(dims) >= 2 else "dp"


def _first_dims(event: dict) -> list:
    dims = event.get("args", {}).get("Input Dims") or []
    first = dims[0] if dims else []
    if first and isinstance(first[0], list):  # a TensorList: its first tensor
        first = first[0]
    return list(first or [])


def _label(name: str) -> str | None:
    if name in (FORWARD,):
        return "forward"
    if name == BACKWARD or name.startswith("autograd::engine::evaluate_function"):
        return "backward"
    if name == OPTIMIZER or name.startswith("Optimizer."):
        return "optimizer"
    if name.startswith(("aten::", "fsdp::", "FSDP::")):
        return "other"
    return None


def _nbytes(event: dict) -> float:
    """The bytes of an event's first tensor argument."""
    types = event.get("args", {}).get("Input type") or []
    first = _first_dims(event)
    if not first or not types:
        return 0.0
    count = 1
    for d in first:
        count *= int(d)
    return float(count * _DTYPE_BYTES.get(types[0], 4))


def _matmul_dims(event: dict) -> tuple[int, int, int] | None:
    dims = event.get("args", {}).get("Input Dims") or []
    shapes = [d for d in dims if isinstance(d, list) and len(d) >= 2]
    if len(shapes) < 2:
        return None
    a, b = shapes[-2], shapes[-1]  # addmm/baddbmm: (bias, a, b); mm/bmm: (a, b)
    batch = int(a[0]) if len(a) == 3 else 1
    return batch * int(a[-2]), int(b[-1]), int(a[-1])


def _paint(window: tuple[float, float], spans: list[tuple[float, float, str, int]],
           computing: list[tuple[float, float]] | None = None) -> dict[str, float]:
    """Seconds per label inside ``window``. Each instant goes to the highest-priority span
    over it; unpainted time between two equal labels takes that label; what is left goes to
    a background span over it (priority < 0: a collective in flight while the main thread
    waits), else is idle. The pieces that go to compute are added to ``computing``."""
    lo, hi = window
    # a sweep over the span boundaries, counting the open spans of each label
    marks = []
    for s, e, label, prio in spans:
        s, e = max(lo, s), min(hi, e)
        if e > s:
            marks += [(s, 1, label, prio), (e, -1, label, prio)]
    marks.sort(key=lambda m: (m[0], m[1]))
    open_spans: dict[tuple[int, str], int] = defaultdict(int)
    pieces: list[tuple[float, float, str | None, str | None]] = []
    at = lo

    def close(until: float) -> None:
        live = [k for k, n in open_spans.items() if n > 0]
        front = max((k for k in live if k[0] >= 0), default=None)
        back = max((k for k in live if k[0] < 0), default=None)
        pieces.append((at, until, front[1] if front else None, back[1] if back else None))

    for t, delta, label, prio in marks:
        if t > at:
            close(t)
            at = t
        open_spans[(prio, label)] += delta
    if hi > at:
        close(hi)
    before, after = [None] * len(pieces), [None] * len(pieces)
    for i in range(1, len(pieces)):
        before[i] = pieces[i - 1][2] if pieces[i - 1][2] is not None else before[i - 1]
    for i in range(len(pieces) - 2, -1, -1):
        after[i] = pieces[i + 1][2] if pieces[i + 1][2] is not None else after[i + 1]
    totals: dict[str, float] = defaultdict(float)
    for i, (a, b, label, background) in enumerate(pieces):
        if label is None:
            if before[i] is not None and before[i] == after[i]:
                label = before[i]
            else:
                label = background or "idle"
        totals[label] += (b - a) * 1e-6
        if computing is not None and label in _PRIORITY:
            computing.append((a, b))
    return dict(totals)


def summarize_trace(trace: dict, mesh: dict | None = None) -> dict:
    """The summary of one rank's trace (see the module docstring): ``steps`` (each step's
    seconds by term), ``step_s`` and ``terms_s`` (their medians), ``matmuls``
    ([m, n, k, dtype_bytes, seconds] per call), ``collectives`` ([kind, axis, bytes of its
    first tensor, seconds, seconds of it while the main thread computed] per call, on the
    backend's threads), ``ops_per_step``. A step's communication terms are named
    ``comm:KIND:AXIS``."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    steps = sorted((e for e in events if e["name"] == STEP), key=lambda e: e["ts"])
    if not steps:
        raise ValueError("the trace holds no autopar.step event: was it written by "
                         "autopar run --profile?")
    main = steps[0]["tid"]
    mine = sorted((e for e in events if e["tid"] == main), key=lambda e: e["ts"])
    per_step: list[dict[str, float]] = []
    painted: list[tuple[float, float]] = []  # when the main thread computed
    ops = []
    last_functional = "other_comm:control"
    for step in steps:
        lo, hi = step["ts"], step["ts"] + step["dur"]
        inside = [e for e in mine if lo <= e["ts"] < hi and e is not step]
        spans = []
        for e in inside:
            kind = collective_kind(e["name"])
            if kind is not None and kind != "wait":
                kind = f"{kind}:{collective_axis(kind, e, mesh)}"
            if kind == "wait":  # a functional collective's wait: the kind it waits for
                kind = last_functional
            elif kind is not None and not kind.startswith("other_comm") and \
                    e["name"].startswith("_c10d_functional::"):
                last_functional = kind
            if kind is not None:
                # the backend's own range on the main thread (gloo's send/recv) lasts until
                # the transfer completes, whatever the thread does meanwhile: background
                prio = -1 if e["name"].startswith(_BACKEND) else 4
                spans.append((e["ts"], e["ts"] + e["dur"], f"comm:{kind}", prio))
                continue
            label = _label(e["name"])
            if label is not None:
                spans.append((e["ts"], e["ts"] + e["dur"], label, _PRIORITY[label]))
        per_step.append(_paint((lo, hi), spans, painted))
        ops.append(sum(1 for e in inside if e["name"].startswith("aten::")))
    matmuls = []
    for e in events:
        if e["name"] in _MATMULS and e["tid"] == main:
            dims = _matmul_dims(e)
            if dims is not None:
                types = e.get("args", {}).get("Input type") or ["float"]
                matmuls.append([*dims, _DTYPE_BYTES.get(types[-1], 4), e["dur"] * 1e-6])
    # the backend's own threads run the collectives on the wire (on the main thread, gloo's
    # send/recv ranges include the wait for the peer: not a transfer time)
    computing = _union(painted)
    windows = [(e["ts"], e["ts"] + e["dur"]) for e in steps]
    collectives = []
    for e in sorted(events, key=lambda e: e["ts"]):  # in issue order: ranks' calls pair up
        if e["name"].startswith(_BACKEND) and e["tid"] != main and \
                any(lo <= e["ts"] < hi for lo, hi in windows):
            kind = collective_kind(e["name"])
            if kind not in (None, "wait", "other_comm", "barrier"):
                beside = _overlap(computing, e["ts"], e["ts"] + e["dur"])
                collectives.append([kind, collective_axis(kind, e, mesh), _nbytes(e),
                                    e["dur"] * 1e-6, beside * 1e-6])
    terms = sorted({k for s in per_step for k in s})
    return {
        "steps": per_step,
        "step_s": statistics.median(s["dur"] * 1e-6 for s in steps),
        "terms_s": {k: statistics.median(s.get(k, 0.0) for s in per_step) for k in terms},
        "matmuls": matmuls,
        "collectives": collectives,
        "ops_per_step": statistics.median(ops),
        "profiled_steps": len(steps),
    }


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for a, b in sorted(spans):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def _overlap(union: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Length of [lo, hi) covered by the sorted disjoint ``union``."""
    import bisect

    i = max(bisect.bisect_right(union, (lo, float("inf"))) - 1, 0)
    total = 0.0
    while i < len(union) and union[i][0] < hi:
        a, b = union[i]
        total += max(0.0, min(b, hi) - max(a, lo))
        i += 1
    return total


def read_trace(path: str | Path) -> dict:
    """A Chrome trace JSON file (``.json`` or ``.json.gz``)."""
    path = Path(path)
    if path.suffix == ".gz":
        import gzip

        with gzip.open(path, "rt") as f:
            return json.load(f)
    return json.loads(path.read_text())


def mark_forward(module) -> None:
    """Open a ``autopar.forward`` profiler range around each forward of ``module`` (a
    pipeline stage, whose schedule runs the forwards itself)."""
    from torch.profiler import record_function

    ranges: list = []

    def enter(*_):
        ranges.append(record_function(FORWARD).__enter__())

    def leave(*_):
        if ranges:
            ranges.pop().__exit__(None, None, None)

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave)
