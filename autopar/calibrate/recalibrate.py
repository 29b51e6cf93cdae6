"""``autopar profile --from-run DIR``: a cost profile fitted to runs of this machine.

Each DIR is an artifact that ``autopar run DIR --profile`` trained. From its logs come the
measured step (the median of the steps the profiler did not slow: not the run's first, nor
the profiler's warm-up and window) and every rank's profile summary (matmul calls, collective
calls on the backend threads). The plan the run executed is priced again
(:func:`autopar.search.replay.plan_config`) while the profile's factors are fitted
(:mod:`autopar.calibrate.fit`):

1. matmul efficiency by shape class, from the matmul calls;
2. each collective's latency and bandwidth on the link the runs used (inside one node), from
   its calls, with the group size the plan gives each axis;
3. the overlap of data-parallel collectives with compute, from the same calls;
4. last, the per-op overhead: the value that makes the model's step times equal the measured
   ones, the other factors fixed.

The result is the runs' cluster file with those numbers replaced (each source says so) and a
``calibration`` section recording the runs, their measured and predicted steps before and
after. It loads as ``cluster=PATH``.
"""

from __future__ import annotations

import copy
import json
import statistics
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import yaml

from autopar.artifact import load_artifact
from autopar.calibrate import fit
from autopar.capture import capture
from autopar.cost.estimate import estimate
from autopar.cost.hardware import cluster_file, parse_cluster
from autopar.cost.pipeline import lone_stage_speedup
from autopar.errors import PlanError
from autopar.ir.graph import Graph
from autopar.models import token_inputs
from autopar.models.source import build_from_source
from autopar.plan import Plan
from autopar.search.replay import plan_config

OVERHEAD_RANGE_S = (0.0, 2e-3)  # per modelled op: its dispatches, hooks and Python
_RING_MODELS = {"all_reduce": "2(n-1) alpha + 2(n-1)/n bytes/beta",
                "all_gather": "(n-1) alpha + (n-1)/n bytes/beta",
                "reduce_scatter": "(n-1) alpha + (n-1)/n bytes/beta",
                "all_to_all": "(n-1) alpha + (n-1)/n bytes/beta",
                "broadcast": "ceil(log2 n) alpha + bytes/beta", "send_recv": "alpha + bytes/beta"}


@dataclass
class Run:
    """One profiled run: its plan, the plan's graph, the measured step, the ranks' summaries."""

    directory: Path
    plan: Plan
    graph: Graph
    step_s: float
    ranks: list[dict]


def read_run(directory: str | Path) -> Run:
    """A trained, profiled artifact (refused in one line when it is not)."""
    d = Path(directory)
    manifest, plan = load_artifact(d)
    if plan.task == "infer":
        raise PlanError(f"{d} is a serving artifact; --from-run fits a training run's step")
    profile = d / "logs" / "profile"
    summary_path = profile / "summary.json"
    if not summary_path.is_file():
        raise PlanError(f"{d} has no profile: train it with torchrun ... -m autopar run {d} "
                        f"--profile, then recalibrate from it")
    summary = json.loads(summary_path.read_text())
    ranks = [json.loads(p.read_text()) for p in sorted(profile.glob("rank*.summary.json"))]
    ranks = [r for r in ranks if "terms_s" in r]
    if not ranks:
        raise PlanError(f"{profile} holds no rank summary; run with --profile again")
    return Run(d, plan, plan_graph(manifest, plan), _unprofiled_step(d, summary), ranks)


def _unprofiled_step(d: Path, summary: dict) -> float:
    records = [json.loads(x) for x in (d / "logs" / "train.jsonl").read_text().splitlines()
               if x.strip()]
    first = int(summary.get("first_step", 0))
    lo, hi = summary["window"]
    last_run = {r["step"]: r for r in records}  # a re-run's records replace the older ones
    # not the run's first step (start-up), nor the profiler's warm-up step and window
    plain = [r["step_time_s"] for s, r in last_run.items()
             if first < s < first + max(lo - 1, 0) or s >= first + hi]
    if not plain:
        raise PlanError(f"{d}: every step of the run was profiled or warming up; train with "
                        f"more steps than the profiled window plus two (e.g. --steps "
                        f"{hi + 3} --profile-steps {hi}:{hi + 3})")
    return statistics.median(plain)


def plan_graph(manifest: dict, plan: Plan) -> Graph:
    """The plan's model captured as the plan captured it (names match its layout)."""
    shapes = list(plan.model.get("inputs", {}).values())
    if not shapes or len(shapes[0]) != 2:
        raise PlanError("recalibration re-captures token models ([batch, seq] token ids); "
                        "this plan's inputs are not")
    model = build_from_source(manifest["model"], 0, "meta")
    return capture(model, token_inputs(*shapes[0]), peft=plan.peft or None)


def base_mapping(cluster: str) -> dict:
    """The cluster file the runs were planned with, as a mapping (catalog name or path)."""
    path = cluster_file(cluster)
    if path is None:
        raise PlanError(f"the runs were planned for cluster '{cluster}', which is not here; "
                        f"pass its file with --base PROFILE.yaml")
    return yaml.safe_load(path.read_text())


def _matmul_samples(runs: list[Run], cluster) -> list[list[float]]:
    """Every matmul call, its time put at the all-busy rate the profile's peak stands for: a
    pipeline stage whose neighbours idle computes up to :func:`lone_stage_speedup` faster on
    shared cores, so its calls count that much slower (at worst, all of them alone)."""
    out = []
    for r in runs:
        speedup = lone_stage_speedup(plan_config(r.plan, r.graph), cluster)
        for rank in r.ranks:
            out += [[m, n, k, b, t * speedup] for m, n, k, b, t in rank["matmuls"]]
    return out


def _ranks_of(plan: Plan, axis: str) -> int:
    m = plan.mesh
    return {"tp": m["tp"], "dp": m["dp"] * m["ep"], "ep": m["ep"], "pp": 2}.get(axis, 1)


def _collective_samples(runs: list[Run]) -> tuple[list, list]:
    """(``(kind, ranks, bytes, seconds)`` per collective as the cost model sizes it,
    ``(seconds, seconds beside compute)`` of the data-parallel ones).

    A collective's time on a rank includes waiting for the others to arrive; the rank that
    arrived last waited least, so each collective counts at the shortest of its ranks' times
    (the n-th call of one kind, axis and size on every rank is the same collective)."""
    calls, overlapped = [], []
    for run in runs:
        same: dict[tuple, list[list]] = {}
        for rank in run.ranks:
            seen: dict[tuple, int] = {}
            for kind, axis, first_bytes, seconds, beside in rank["collectives"]:
                if axis == "control":
                    continue
                key = (kind, axis, first_bytes)
                index = seen[key] = seen.get(key, -1) + 1
                same.setdefault((*key, index), []).append((seconds, beside))
        for (kind, axis, first_bytes, _), times in same.items():
            n = _ranks_of(run.plan, axis)
            # an all-gather's first tensor is this rank's input; the model sizes the whole
            nbytes = first_bytes * n if kind == "all_gather" else first_bytes
            calls.append((kind, n, nbytes, min(t for t, _ in times)))
            if axis == "dp":
                overlapped += times
    return calls, overlapped


def _swept_points(mapping: dict) -> list[tuple[str, int, float, float]]:
    """The base profile's own collective sweep (``autopar profile``: sizes from kilobytes up,
    on all its processes) as calls: a run's collectives come in few sizes (gradient buckets,
    activations), the sweep pins the latency of the small ones."""
    ranks = int((mapping.get("profile") or {}).get("nprocs", 0))
    if ranks < 2:
        return []
    out = []
    for kind, entry in (mapping.get("collectives") or {}).items():
        for point in (entry or {}).get("points") or []:
            nbytes, seconds = float(point[0]), float(point[1])
            out.append((str(kind), ranks, nbytes, seconds))
    return out


def recalibrate(directories: list[str | Path], base: str | None = None) -> dict:
    """The fitted profile (a catalog mapping) from the runs in ``directories``."""
    runs = [read_run(d) for d in directories]
    clusters = {r.plan.cluster for r in runs}
    if base is None and len(clusters) > 1:
        raise PlanError(f"the runs were planned for different clusters ({', '.join(sorted(clusters))}); "
                        f"recalibrate runs of one machine, or name the base with --base")
    mapping = base_mapping(base or runs[0].plan.cluster)
    before = parse_cluster(mapping, "base")
    out = copy.deepcopy(mapping)
    dev, sources = out["device"], out.setdefault("sources", {})
    names = ", ".join(str(r.directory) for r in runs)
    said = f"fitted by autopar profile --from-run on {names}"

    classes = fit.matmul_classes(_matmul_samples(runs, before), dict(before.device.peak_flops))
    if classes:
        dev["efficiency"]["matmul_by_flops"] = classes
        sources["matmul_by_flops"] = f"{said}: median achieved / peak per decade of FLOPs"
    calls, overlapped = _collective_samples(runs)
    # the kinds (and group sizes) the runs measured, each fitted with the base's sweep beside
    measured_kinds = {k for kind, n, _, _ in calls for k in (kind, f"{kind}@{n}")}
    fits = {k: v for k, v in fit.ring_fit(calls + _swept_points(mapping)).items()
            if k in measured_kinds}
    if before.device.backend == "gloo":
        # gloo runs a reduce-scatter as an all-reduce of the whole input: the same wire time
        for key in [k for k in fits if k.split("@")[0] == "all_reduce"]:
            twin = key.replace("all_reduce", "reduce_scatter")
            if twin not in fits:
                alpha, beta, count = fits[key]
                fits[twin] = (2 * alpha, beta / 2, count)
    collectives = out.get("collectives") or {}
    out["collectives"] = collectives
    for key, (alpha, beta, count) in sorted(fits.items(), key=lambda kv: "@" in kv[0]):
        kind, _, ranks = key.partition("@")
        entry = {"alpha": alpha, "beta": beta, "samples": count}
        if ranks:  # the kind's own fit came first (sorted), replacing the base file's
            collectives[kind].setdefault("by_ranks", {})[int(ranks)] = entry
        else:
            collectives[kind] = dict(entry, model=_RING_MODELS.get(kind, ""), link="intra",
                                     source=said)
    share = fit.overlap_share(overlapped)
    if share is not None:
        dev["overlap"]["concurrent"] = share
        sources["overlap"] = f"{said}: concurrent = share of data-parallel collective time " \
                             f"beside compute; compute_slowdown as the base file"

    def predicted(overhead: float) -> list[float]:
        dev["kernel_overhead_s"] = overhead
        cluster = parse_cluster(out, "fitted")
        return [estimate(r.graph, cluster, plan_config(r.plan, r.graph)).step_time_s
                for r in runs]

    measured = [r.step_s for r in runs]
    base_steps = [estimate(r.graph, before, plan_config(r.plan, r.graph)).step_time_s
                  for r in runs]
    overhead = fit.fit_scalar(predicted, measured, *OVERHEAD_RANGE_S)
    after = predicted(overhead)
    sources["kernel_overhead_s"] = f"{said}: the per-op overhead that makes the model's " \
                                   f"step times of the runs equal the measured ones"
    out["name"] = f"{mapping.get('name', 'profile')}-from-run"
    out["calibration"] = {
        "from_runs": [str(r.directory) for r in runs],
        "base": base or runs[0].plan.cluster,
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "runs": [{"directory": str(r.directory), "mesh": dict(r.plan.mesh),
                  "measured_step_s": m, "predicted_before_s": b, "predicted_after_s": a}
                 for r, m, b, a in zip(runs, measured, base_steps, after, strict=True)],
        "samples": {"matmul_calls": sum(len(k["matmuls"]) for r in runs for k in r.ranks),
                    "collective_calls": len(calls)},  # with the base's sweep: "samples"
    }
    return out
