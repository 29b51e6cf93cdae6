"""Plan a small GPT for 4 CPU processes, compile it, and train it with torchrun.

Run: python examples/train_gpt_cpu.py [OUT_DIR]
(the same as: autopar compile ... then torchrun --nproc-per-node 4 OUT_DIR/train.py)
"""

import subprocess
import sys

import autopar
from autopar.models import GPT, GPTConfig, token_inputs

out = sys.argv[1] if len(sys.argv) > 1 else "gpt-4cpu"
model = GPT(GPTConfig(vocab_size=256, seq_len=64, d_model=128, n_layers=4, n_heads=4))
graph = autopar.capture(model, token_inputs(1, 64))

# The cpu catalog entry describes this kind of machine; pin a 2 x 2 pipeline x data mesh
plan = autopar.plan(graph, devices=4, cluster="cpu", global_batch=8,
                    constraints={"pp": 2, "dp": 2, "tp": 1, "schedule": "1f1b"})
print(plan.report())
autopar.compile(model, None, plan, out)
print(open(f"{out}/train.py").read())  # the program autopar generated from the plan

# run the program itself (`autopar run OUT_DIR` runs the same file)
subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", "4", f"{out}/train.py", "--steps", "10", "--device", "cpu",
                "--overwrite"],  # a fresh run each time the example runs
               check=True)
print(open(f"{out}/logs/train.jsonl").read().splitlines()[-1])
