"""Fitting the cost model's efficiency factors to measurements of a run (what ``autopar profile
--from-run`` writes into a profile): plain functions of measured samples, no model or plan.

- matmul efficiency by shape class: each matmul call's achieved rate over the device's peak,
  the median per decade of FLOPs per call;
- collective latency and bandwidth: ``ring_time``'s alpha and beta (the form the cost model
  prices a measured link with) fitted to each collective call's time on its backend thread;
- overlap: the share of the data-parallel collectives' time the main thread spent computing;
- the per-op overhead: the one number that makes the model's step times of the runs equal
  the measured ones (in the log, least squares), the other factors fixed.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Sequence

from autopar.cost.comm import Link, ring_time

DTYPES_BY_BYTES = {4: "fp32", 2: "bf16", 8: "fp32", 1: "fp8"}
MIN_SAMPLES = 3  # fewer calls than this do not make a class or a fit
# A latency and a bandwidth are two unknowns: calls of one message size (one gradient bucket,
# profiled on every step) pin only their sum at that size. A fit needs sizes at least this far
# apart, so that the fixed and the per-byte parts of the time can be told apart.
MIN_SIZE_SPREAD = 4.0


def matmul_classes(samples: Sequence[Sequence[float]], peak_flops: dict[str, float]
                   ) -> list[list[float]]:
    """``efficiency.matmul_by_flops`` from matmul calls ``[m, n, k, dtype_bytes, seconds]``:
    [[10^d FLOPs, achieved / peak of the calls in (10^(d-1), 10^d]], ...] for the decades
    with at least MIN_SAMPLES calls; the last class covers all larger calls. A class's rate is
    its calls' FLOPs over their time (the slow calls weigh what they cost, as in a step)."""
    by_decade: dict[int, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    for m, n, k, nbytes, seconds in samples:
        flops = 2.0 * m * n * k
        peak = peak_flops.get(DTYPES_BY_BYTES.get(int(nbytes), "fp32")) or peak_flops["fp32"]
        if flops <= 0 or seconds <= 0:
            continue
        tally = by_decade[max(0, math.ceil(math.log10(flops)))]
        tally[0] += 1
        tally[1] += flops / peak  # seconds at peak
        tally[2] += seconds
    classes = [[10.0 ** d, min(at_peak / spent, 10.0)]
               for d, (calls, at_peak, spent) in sorted(by_decade.items())
               if calls >= MIN_SAMPLES]
    if classes:
        classes[-1][0] = 1e30  # the largest class measured stands for every larger call
    return classes


def ring_fit(samples: Sequence[tuple[str, int, float, float]]) -> dict[str, tuple[float, float, int]]:
    """Per collective kind, (alpha s per ring step, beta bytes/s, calls) of ``ring_time``
    fitted to calls ``(kind, ranks, bytes, seconds)`` by least squares on the relative error
    (each call weighs alike, small or large), alpha and 1/beta kept non-negative; beside each
    kind's fit, ``"KIND@N"`` fits the calls of groups of N ranks alone. Calls all of about one
    size make no fit (see MIN_SIZE_SPREAD)."""
    by_kind: dict[str, list[tuple[int, float, float]]] = defaultdict(list)
    for kind, ranks, nbytes, seconds in samples:
        if ranks > 1 and nbytes > 0 and seconds > 0:
            by_kind[kind].append((ranks, nbytes, seconds))
            by_kind[f"{kind}@{ranks}"].append((ranks, nbytes, seconds))
    fits = {}
    for kind, calls in by_kind.items():
        sizes = [b for _, b, _ in calls]
        if len(calls) < MIN_SAMPLES or max(sizes) < MIN_SIZE_SPREAD * min(sizes):
            continue
        # ring_time is linear in (alpha, 1/beta): its value at (1, inf) and at (0, 1)
        base = kind.split("@")[0]
        rows = [(ring_time(base, b, n, Link(math.inf, 1.0)), ring_time(base, b, n, Link(1.0, 0.0)),
                 t) for n, b, t in calls]
        alpha, inverse = _nonnegative_least_squares(rows)
        if inverse <= 0:
            continue
        fits[kind] = (alpha, 1.0 / inverse, len(calls))
    return fits


def _nonnegative_least_squares(rows: list[tuple[float, float, float]]) -> tuple[float, float]:
    """min sum ((a x + b y - t) / t)^2 over x, y >= 0 for rows (a, b, t): the unconstrained
    solution if it is non-negative, else the better one-variable fit."""
    def one(index: int) -> float:
        num = sum(r[index] / r[2] for r in rows)
        den = sum((r[index] / r[2]) ** 2 for r in rows)
        return max(num / den, 0.0) if den else 0.0

    saa = sum((a / t) ** 2 for a, _, t in rows)
    sbb = sum((b / t) ** 2 for _, b, t in rows)
    sab = sum(a * b / t ** 2 for a, b, t in rows)
    sa = sum(a / t for a, _, t in rows)
    sb = sum(b / t for _, b, t in rows)
    det = saa * sbb - sab * sab
    if det > 0:
        x = (sa * sbb - sb * sab) / det
        y = (saa * sb - sab * sa) / det
        if x >= 0 and y >= 0:
            return x, y

    def loss(x: float, y: float) -> float:
        return sum(((a * x + b * y) / t - 1) ** 2 for a, b, t in rows)

    only_alpha, only_beta = (one(0), 0.0), (0.0, one(1))
    return min(only_alpha, only_beta, key=lambda xy: loss(*xy))


def overlap_share(samples: Sequence[tuple[float, float]]) -> float | None:
    """The share of collective time ``(seconds, seconds beside compute)`` that ran while the
    main thread computed (None without samples)."""
    total = sum(t for t, _ in samples)
    if total <= 0 or len(samples) < MIN_SAMPLES:
        return None
    return min(1.0, sum(b for _, b in samples) / total)


def fit_scalar(predict: Callable[[float], list[float]], measured: list[float], lo: float,
               hi: float, iterations: int = 60) -> float:
    """The ``x`` in [lo, hi] minimising sum (log predict(x)_i - log measured_i)^2, for a
    ``predict`` that rises with ``x`` (golden-section search on a unimodal error)."""
    def error(x: float) -> float:
        return sum((math.log(p) - math.log(m)) ** 2 for p, m in zip(predict(x), measured,
                                                                     strict=True))

    ratio = (math.sqrt(5) - 1) / 2
    a, b = lo, hi
    c, d = b - ratio * (b - a), a + ratio * (b - a)
    fc, fd = error(c), error(d)
    for _ in range(iterations):
        if fc <= fd:
            b, d, fd = d, c, fc
            c = b - ratio * (b - a)
            fc = error(c)
        else:
            a, c, fc = c, d, fd
            d = a + ratio * (b - a)
            fd = error(d)
    return (a + b) / 2
