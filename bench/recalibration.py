"""Recalibration from runs: does ``autopar profile --from-run`` make the cost model predict
autopar's own runtime better on this machine?

A small GPT on 4 gloo processes (on the 2-core machine they time-share its cores); six plans
drawn from ``autopar.plan`` with their mesh, ZeRO stage, schedule and micro-batch pinned (the
planner picks the layouts) for this machine's quick ``autopar profile``. Each is compiled to an
artifact and trained with ``torchrun ... autopar run DIR --profile``, as a user would. The
bench prints each measured step (the median of the steps the profiler did not slow) against
its prediction; then fits a profile to two of the runs (``autopar profile --from-run A
--from-run B``) and predicts the other four again under it: their error before and after, and
the Spearman rank correlation of the four.

The two fitted runs are the simplest plans of each kind, plain data parallelism and a 1F1B
pipeline; the four held back use what those do not (ZeRO-3, tensor parallelism, another
schedule), and their step times lie at least 20% apart, wider than the run-to-run noise, so
that the rank correlation measures the model rather than the noise.

Usage: python bench/recalibration.py [--work DIR] [--steps 10]
(about 8 minutes on the 2-core machine; run it on a quiet machine: the timings are its input).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODEL = dict(vocab_size=1024, seq_len=128, d_model=256, n_layers=4, n_heads=8)
WORLD, GLOBAL_BATCH = 4, 16
# name -> pins; the first two are the runs the profile is fitted to
CASES: dict[str, dict] = {
    "dp4": dict(dp=4, tp=1, pp=1, zero_stage=0, microbatch_size=4),
    "pp4 1f1b mb4": dict(pp=4, dp=1, tp=1, microbatch_size=4, schedule="1f1b"),
    "pp4 gpipe": dict(pp=4, dp=1, tp=1, microbatch_size=2, schedule="gpipe"),
    "dp4 zero3": dict(dp=4, tp=1, pp=1, zero_stage=3, microbatch_size=4),
    "dp2 tp2 zero3": dict(dp=2, tp=2, pp=1, zero_stage=3, microbatch_size=8),
    "tp4": dict(tp=4, dp=1, pp=1, microbatch_size=8),
}
FITTED_FROM = list(CASES)[:2]


def _cli(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "autopar", *args], check=True, timeout=900)


def compile_case(name: str, pins: dict, profile: Path, work: Path) -> Path:
    import autopar
    from autopar.models import GPT, GPTConfig, token_inputs

    model = GPT(GPTConfig(**MODEL))
    inputs = token_inputs(pins["microbatch_size"], MODEL["seq_len"])
    plan = autopar.plan(model, inputs, devices=WORLD, global_batch=GLOBAL_BATCH,
                        cluster=str(profile),
                        constraints={"ep": 1, "offload": [], "recompute": "none",
                                     "sequence_parallel": False, "precision": "fp32", **pins})
    out = work / name.replace(" ", "-")
    autopar.compile(model, inputs, plan, out)
    return out


def train(directory: Path, steps: int) -> float:
    """Train with the profiler on the last 3 steps; the median step it did not slow."""
    window = f"{steps - 3}:{steps}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(WORLD), "-m", "autopar", "run", str(directory), "--steps", str(steps),
           "--device", "cpu", "--profile", "--profile-steps", window, "--quiet"]
    subprocess.run(cmd, check=True, timeout=900, capture_output=True, text=True,
                   env=dict(os.environ, OMP_NUM_THREADS="1"))
    records = [json.loads(x) for x in (directory / "logs" / "train.jsonl").read_text()
               .splitlines()]
    # step 0 warms up; the profiler runs from the step before its window
    return statistics.median(r["step_time_s"] for r in records[1:steps - 4])


def predict(directory: Path, cluster: str) -> float:
    """The artifact's plan priced under ``cluster`` (its recorded choice, not a new search)."""
    from autopar.calibrate.recalibrate import plan_graph
    from autopar.codegen import load_artifact
    from autopar.cost.estimate import estimate
    from autopar.search.replay import plan_config

    manifest, plan = load_artifact(directory)
    graph = plan_graph(manifest, plan)
    return estimate(graph, cluster, plan_config(plan, graph)).step_time_s


def spearman(xs: list[float], ys: list[float]) -> float:
    def ranks(v: list[float]) -> list[int]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        out = [0] * len(v)
        for r, i in enumerate(order):
            out[i] = r
        return out

    rx, ry = ranks(xs), ranks(ys)
    n = len(xs)
    return 1 - 6 * sum((a - b) ** 2 for a, b in zip(rx, ry, strict=True)) / (n * (n * n - 1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", help="keep the artifacts and profiles here")
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="autopar-recal-"))
    work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    base = work / "quick.yaml"
    if not base.is_file():
        _cli("profile", "--quick", "--nprocs", str(WORLD), "--out", str(base), "--quiet")
    dirs, measured = {}, {}
    print(f"{'plan (4 processes)':<16} {'measured s':>10} {'predicted s':>11} {'error':>7}")
    for name, pins in CASES.items():
        dirs[name] = compile_case(name, pins, base, work)
        measured[name] = train(dirs[name], args.steps)
        before = predict(dirs[name], str(base))
        print(f"{name:<16} {measured[name]:>10.3f} {before:>11.3f} "
              f"{(before - measured[name]) / measured[name]:>+7.0%}", flush=True)
    fitted = work / "fitted.yaml"
    # the plans name the quick profile's machine, not its file: --base gives the file
    _cli("profile", "--from-run", str(dirs[FITTED_FROM[0]]), "--from-run",
         str(dirs[FITTED_FROM[1]]), "--base", str(base), "--out", str(fitted), "--quiet")
    held = [n for n in CASES if n not in FITTED_FROM]
    print(f"\nfitted {fitted.name} from {', '.join(FITTED_FROM)}; the other four:")
    print(f"{'plan':<16} {'measured s':>10} {'before s':>9} {'error':>7} {'after s':>8} "
          f"{'error':>7}")
    rows = []
    for name in held:
        before, after = predict(dirs[name], str(base)), predict(dirs[name], str(fitted))
        m = measured[name]
        rows.append((m, before, after))
        print(f"{name:<16} {m:>10.3f} {before:>9.3f} {(before - m) / m:>+7.0%} {after:>8.3f} "
              f"{(after - m) / m:>+7.0%}")
    ms, bs, as_ = ([r[i] for r in rows] for i in range(3))
    med = lambda ps: statistics.median(abs(p - m) / m for p, m in zip(ps, ms, strict=True))  # noqa: E731
    print(f"\nheld-out median |error|: before {med(bs):.0%}, after {med(as_):.0%}")
    print(f"held-out Spearman: before {spearman(bs, ms):.2f}, after {spearman(as_, ms):.2f}")
    print(f"({time.perf_counter() - started:.0f} s; artifacts in {work})")


if __name__ == "__main__":
    main()
