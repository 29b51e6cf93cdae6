"""LoRA against full fine-tuning, as the planner sees them: the plan it chooses for each and
the per-device memory it predicts (Llama-3-8B on 8 x a100-40g by default).

With the base frozen, LoRA needs no gradients and no optimizer states for it, so the plan that
fits changes: full fine-tuning must shard its states (ZeRO) or split the model, LoRA need not.

Usage: python bench/lora_vs_full.py [--model llama3-8b] [--devices 8] [--cluster a100-40g]
                                    [--global-batch 64] [--seq 2048]
"""

from __future__ import annotations

import argparse
import time

import autopar

GB = 1e9


def _row(name: str, plan, seconds: float) -> str:
    m, mem = plan.mesh, plan.predicted.memory
    shape = f"dp{m['dp']} tp{m['tp']} pp{m['pp']} ZeRO-{plan.zero_stage}"
    recompute = "+".join(sorted(set(plan.recompute) - {"none"})) or "none"
    offload = "+".join(plan.offload) or "none"
    return (f"{name:<6} {shape:<22} {plan.microbatch_size:>3}x{plan.num_microbatches:<4} "
            f"{recompute:<15} {offload:<17} {plan.trainable_params / 1e6:>9.1f} "
            f"{mem['params'] / GB:>7.2f} {mem['grads'] / GB:>7.2f} {mem['optimizer'] / GB:>7.2f} "
            f"{mem['activations'] / GB:>7.2f} {mem['total'] / GB:>7.2f} "
            f"{plan.predicted.step_time_s:>8.3f} {seconds:>6.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--cluster", default="a100-40g")
    ap.add_argument("--global-batch", type=int, default=64)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--lora", default="method=lora,r=8,lora_alpha=16,target_modules=all-linear")
    args = ap.parse_args()
    print(f"{args.model} on {args.devices} x {args.cluster}, global batch {args.global_batch}, "
          f"seq {args.seq}; per-device memory in GB (predicted)")
    print(f"{'task':<6} {'plan':<22} {'mbxn':>8} {'recompute':<15} {'offload':<17} {'train M':>9} "
          f"{'params':>7} {'grads':>7} {'optim':>7} {'acts':>7} {'total':>7} {'step s':>8} "
          f"{'plan s':>6}")
    for name, peft in (("full", None), ("lora", args.lora)):
        start = time.perf_counter()
        plan = autopar.plan(args.model, devices=args.devices, cluster=args.cluster,
                            global_batch=args.global_batch, seq=args.seq, task="finetune",
                            peft=peft)
        print(_row(name, plan, time.perf_counter() - start))


if __name__ == "__main__":
    main()
