"""Planner speed: capture time, search time and whole autopar.plan time (median of 3 fresh
processes each) for the models and device counts of issue 4.

Usage: python bench/planner_speed.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

CASES = [("llama3-8b", 8, 64, 4096), ("llama3-8b", 64, 512, 4096), ("llama3-70b", 64, 512, 4096),
         ("llama3-70b", 512, 2048, 4096), ("gpt3-175b", 1024, 1536, 2048),
         ("mixtral-8x7b", 64, 512, 4096)]

CHILD = r"""
import json, sys, time
import os
os.environ["AUTOPAR_CACHE"] = "off"  # time torch.export, not the graph cache
import autopar
name, devices, batch, seq = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
t0 = time.perf_counter()
graph = autopar.capture(name, seq=seq)
t1 = time.perf_counter()
plan = autopar.plan(graph, devices=devices, global_batch=batch)
t2 = time.perf_counter()
print(json.dumps({"capture_s": t1 - t0, "search_s": t2 - t1, "mesh": plan.mesh,
                  "zero": plan.zero_stage, "schedule": plan.schedule,
                  "mfu": plan.predicted.mfu, "gap": plan.solver["gap"],
                  "evaluated": plan.solver["evaluated"]}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    print(f"{'model':<13} {'devices':>7} {'batch':>5} {'capture s':>9} {'search s':>8} "
          f"{'plan s':>6} {'evaluated':>9} {'gap':>5}  plan")
    for name, devices, batch, seq in CASES:
        runs = []
        for _ in range(args.repeats):
            out = subprocess.run([sys.executable, "-c", CHILD, name, str(devices), str(batch),
                                  str(seq)], capture_output=True, text=True, check=True)
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
        cap = statistics.median(r["capture_s"] for r in runs)
        search = statistics.median(r["search_s"] for r in runs)
        whole = statistics.median(r["capture_s"] + r["search_s"] for r in runs)
        r = runs[0]
        m = r["mesh"]
        print(f"{name:<13} {devices:>7} {batch:>5} {cap:>9.1f} {search:>8.2f} {whole:>6.1f} "
              f"{r['evaluated']:>9} {r['gap']:>5.0%}  pp{m['pp']} dp{m['dp']} tp{m['tp']} "
              f"ep{m['ep']} ZeRO-{r['zero']} {r['schedule']} MFU {r['mfu']:.0%}")


if __name__ == "__main__":
    main()
