"""Compare a few hand-written parallel strategies for Llama-3-8B on 64 A100-80G with the cost
model (the search in `autopar.plan` explores all of them; this shows what it weighs).

Run: python examples/estimate_llama.py [CLUSTER]   (a catalog name or an `autopar profile` YAML)
"""

import sys

import autopar
from autopar.cost import ParallelConfig, estimate, load_cluster

cluster = load_cluster(sys.argv[1] if len(sys.argv) > 1 else "a100-80g")
graph = autopar.capture("llama3-8b", seq=8192)  # meta device: seconds, no weights
capacity = cluster.device.usable_memory_bytes

candidates = {
    "FSDP (ZeRO-3) x 64, selective": ParallelConfig(dp=64, zero_stage=3, recompute="selective"),
    "FSDP x 64, no recompute": ParallelConfig(dp=64, zero_stage=3),
    "DDP x 64, full recompute": ParallelConfig(dp=64, recompute="full"),
    "TP 8 x DP 8, SP, ZeRO-1": ParallelConfig(dp=8, tp=8, sequence_parallel=True, zero_stage=1,
                                              microbatch_size=8),
    "PP 4 x TP 2 x DP 8, 1F1B": ParallelConfig(dp=8, tp=2, pp=4, microbatch_size=1,
                                               num_microbatches=8, zero_stage=1),
}
print(f"{'strategy':<34} {'step s':>7} {'MFU':>6} {'tok/s':>9} {'mem GB':>7}  fits")
for name, config in candidates.items():
    est = estimate(graph, cluster, config)
    print(f"{name:<34} {est.step_time_s:>7.2f} {est.mfu:>6.1%} {est.tokens_per_s:>9.0f} "
          f"{est.memory.total / 1e9:>7.1f}  {'yes' if est.fits(capacity) else 'NO'}")
