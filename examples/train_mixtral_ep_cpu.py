"""Expert parallelism on CPU: plan the shipped tiny Mixtral for 2 processes with its experts
split over them (ep=2, ZeRO-3), compile, train with torchrun, and check the losses against one
process trained from the same weights.

Run: python examples/train_mixtral_ep_cpu.py [OUT_DIR]
"""

import json
import subprocess
import sys

import autopar


def train(plan, out: str, procs: int) -> list[float]:
    autopar.compile("tiny-mixtral", None, plan, out)
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                    "--nproc-per-node", str(procs), "-m", "autopar", "run", out, "--steps", "4",
                    "--device", "cpu", "--overwrite"], check=True)  # a fresh run each time
    with open(f"{out}/logs/train.jsonl") as f:
        return [json.loads(line)["loss"] for line in f]


out = sys.argv[1] if len(sys.argv) > 1 else "mixtral-ep2"
graph = autopar.capture("tiny-mixtral", seq=32)
ep = autopar.plan(graph, devices=2, cluster="cpu", global_batch=4,
                  constraints={"ep": 2, "dp": 1, "tp": 1, "pp": 1, "zero_stage": 3})
print(ep.report())
one = autopar.plan(graph, devices=1, cluster="cpu", global_batch=4,
                   constraints={"microbatch_size": ep.microbatch_size * 2,
                                "num_microbatches": ep.num_microbatches})

sharded, single = train(ep, out, 2), train(one, out + "-one-process", 1)
for step, (a, b) in enumerate(zip(sharded, single, strict=True)):
    print(f"step {step}: ep2 {a:.6f}   one process {b:.6f}")
assert all(abs(a - b) <= 1e-4 * abs(b) for a, b in zip(sharded, single, strict=True))
