"""Plan Llama-3-70B on 64 A100-80G, read the report, pin a different strategy, compare.

Run: python examples/plan_llama.py [DEVICES] [GLOBAL_BATCH]
"""

import sys

import autopar

devices = int(sys.argv[1]) if len(sys.argv) > 1 else 64
batch = int(sys.argv[2]) if len(sys.argv) > 2 else 512

graph = autopar.capture("llama3-70b", seq=4096)  # meta device, ~10 s
best = autopar.plan(graph, devices=devices, global_batch=batch)
print(best.report())
best.save("llama3-70b.plan.yaml")

# What would Megatron-style 3D parallelism with tp=8 cost under the same model? (Megatron's
# distributed optimizer is ZeRO-1; under tensor parallelism autopar's runtime runs ZeRO-2.)
megatron = autopar.plan(graph, devices=devices, global_batch=batch,
                        constraints={"tp": 8, "sequence_parallel": True, "zero_stage": 2})
slower = megatron.predicted.step_time_s / best.predicted.step_time_s - 1
print(f"\npinned tp=8 + SP + ZeRO-2: {megatron.mesh}, step {megatron.predicted.step_time_s:.2f} s "
      f"({slower:+.1%} vs the chosen plan)")
