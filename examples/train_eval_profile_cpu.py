"""Train as people train, on 2 CPU processes: a warm-up then cosine schedule, held-out
evaluation and a profile, then the run beside its plan (what `autopar report DIR --run`
prints).

Run: python examples/train_eval_profile_cpu.py [OUT_DIR]
(the same as: autopar compile ...; torchrun ... -m autopar run OUT_DIR ...; autopar report
OUT_DIR --run)
"""

import json
import subprocess
import sys
from pathlib import Path

import autopar
from autopar.report.run import load_run

out = Path(sys.argv[1] if len(sys.argv) > 1 else "tiny-llama-train")

# A tiny Llama on the cpu catalog, split into two pipeline stages of one process each
plan = autopar.plan("tiny-llama", devices=2, cluster="cpu", global_batch=4, seq=32,
                    constraints={"pp": 2, "dp": 1, "microbatch_size": 1})
autopar.compile("tiny-llama", None, plan, out)
print(f"compiled {out}: mesh {plan.mesh}, {plan.num_microbatches} micro-batches, predicted "
      f"step {plan.predicted.step_time_s * 1e3:.2f} ms")


# 8 steps: 2 of warm-up to 3e-3, then cosine decay towards 3e-4; held-out loss every 4 steps;
# the profiler records the last 3 steps (after a warm-up step of its own)
steps = 8
subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", "2", "-m", "autopar", "run", str(out),
                "--steps", str(steps), "--device", "cpu", "--overwrite",  # a fresh run each time
                "--lr", "3e-3", "--warmup-steps", "2", "--lr-schedule", "cosine",
                "--min-lr", "3e-4", "--weight-decay", "0.1", "--betas", "0.9,0.95",
                "--eval", "synthetic", "--eval-every", "4", "--profile"],
               check=True)  # a console line per step, then the profile's summary

logs = out / "logs"
rates = [json.loads(line)["lr"] for line in (logs / "train.jsonl").read_text().splitlines()]
print("learning rate per step:", " ".join(f"{r:.2g}" for r in rates))
print("traces (open in ui.perfetto.dev):",
      ", ".join(p.name for p in sorted((logs / "profile").glob("rank*.trace.json"))))

# The plan's report with the run beside it: what `autopar report OUT_DIR --run` prints
# (plan.report("html", run=...) is the page with the figures)
print(autopar.Plan.load(out / "plan.yaml").report(run=load_run(out)))
