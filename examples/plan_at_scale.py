"""GPT-3 175B on 1,536 A100-80G: the free plan against ZeRO-3 alone and a Megatron-style 3D
layout, each with its step time, throughput and step under the robustness checks.

    python examples/plan_at_scale.py [--devices 1536] [--global-batch 1536]

Everything is predicted on this machine in seconds: no GPU is needed.
"""

from __future__ import annotations

import argparse

import autopar


def describe(plan: autopar.Plan) -> str:
    m = plan.mesh
    text = f"tp{m['tp']} pp{m['pp']} dp{m['dp']} ZeRO-{plan.zero_stage}"
    if m["pp"] > 1:
        text += f" {plan.schedule}" + (f"/v{plan.virtual_stages}" if plan.virtual_stages > 1
                                       else "")
    return text + f" mb {plan.microbatch_size}x{plan.num_microbatches}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, default=1536)
    ap.add_argument("--global-batch", type=int, default=1536)
    args = ap.parse_args()
    graph = autopar.capture("gpt3-175b", seq=2048)
    kwargs = dict(devices=args.devices, cluster="a100-80g", global_batch=args.global_batch)
    pp = 12 if (args.devices // 8) % 12 == 0 else 8  # SC21's 175B runs used tp 8 x pp 12
    plans = {
        "free plan": autopar.plan(graph, **kwargs),
        "ZeRO-3 only": autopar.plan(graph, constraints="zero3-only", **kwargs),
        f"tp 8 x pp {pp}, interleaved": autopar.plan(
            graph, constraints={"tp": 8, "pp": pp, "schedule": "interleaved"}, **kwargs),
    }
    print(f"{'plan':<26} {'layout':<44} {'step s':>7} {'TFLOP/s/GPU':>11} "
          f"{'comm 1.5x':>9} {'overlap/2':>9}")
    for name, plan in plans.items():
        p = plan.predicted
        rate = p.model_flops / p.step_time_s / plan.devices / 1e12
        print(f"{name:<26} {describe(plan):<44} {p.step_time_s:>7.2f} {rate:>11.0f} "
              f"{p.sensitivity['comm_1.5x_s']:>9.2f} {p.sensitivity['overlap_half_s']:>9.2f}")
    free = plans["free plan"]
    robust = free.solver["robust"]
    print(f"\nthe free plan was chosen among {robust['candidates']} plans within 3% of the "
          f"fastest ({robust['fastest_step_time_s']:.2f} s) for its worst case "
          f"({robust['chosen_worst_case_s']:.2f} s); where its step goes:")
    for term, seconds in free.predicted.breakdown.items():
        if seconds > 0:
            print(f"  {term[:-2]:<12} {seconds:8.2f} s")


if __name__ == "__main__":
    main()
