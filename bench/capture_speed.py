"""Capture time and peak memory of real-size models on the meta device.

Each model is captured in a fresh subprocess so its peak RSS is its own.
Usage: python bench/capture_speed.py [--models llama3-70b,mixtral-8x7b] [--seq 4096]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = r"""
import json, resource, sys, time
t0 = time.perf_counter()
import os
os.environ["AUTOPAR_CACHE"] = "off"  # time torch.export, not the graph cache
import autopar
t1 = time.perf_counter()
g = autopar.capture(sys.argv[1], seq=int(sys.argv[2]))
t2 = time.perf_counter()
print(json.dumps({"ops": len(g.ops), "params": g.num_params, "blocks": len(g.blocks),
                  "import_s": t1 - t0, "capture_s": t2 - t1,
                  "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="llama3-8b,llama3-70b,mixtral-8x7b,gpt3-175b")
    ap.add_argument("--seq", type=int, default=4096)
    args = ap.parse_args()
    print(f"{'model':<14} {'seq':>5} {'ops':>6} {'params':>16} {'blocks':>6} "
          f"{'capture s':>9} {'peak RSS GB':>11}")
    for name in args.models.split(","):
        out = subprocess.run([sys.executable, "-c", CHILD, name, str(args.seq)],
                             capture_output=True, text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{name:<14} {args.seq:>5} {r['ops']:>6} {r['params']:>16,} {r['blocks']:>6} "
              f"{r['capture_s']:>9.1f} {r['peak_rss_gb']:>11.2f}")


if __name__ == "__main__":
    main()
