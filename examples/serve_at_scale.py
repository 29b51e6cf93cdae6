"""Serving Llama-3-70B on one 8 x H100-80G node: the plan for N concurrent sequences of a given
context, its per-token latency, prefill and KV cache; the most tokens/s within a latency
bound; and what the planner says when the sequences do not fit.

    python examples/serve_at_scale.py [--model llama3-70b] [--concurrency 32] [--seq 4096]

Everything is predicted on this machine in under a minute: no GPU is needed.
"""

from __future__ import annotations

import argparse

import autopar


def describe(plan: autopar.Plan) -> str:
    m, p = plan.mesh, plan.predicted
    return (f"tp{m['tp']} pp{m['pp']} dp{m['dp']}, {plan.global_batch} sequences: "
            f"{p.decode_s_per_token * 1e3:.1f} ms a token, {p.tokens_per_s:,.0f} tokens/s, "
            f"prefill {p.prefill_s:.2f} s, KV cache {p.kv_cache_bytes / 1e9:.1f} GB and "
            f"{p.memory['total'] / 1e9:.1f} GB in all per device")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama3-70b")
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--cluster", default="h100-80g")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--seq", type=int, default=4096)
    args = ap.parse_args()
    graph = autopar.capture(args.model, seq=args.seq)
    kwargs = dict(devices=args.devices, cluster=args.cluster, task="infer")
    plan = autopar.plan(graph, global_batch=args.concurrency, **kwargs)
    print(f"{args.model} on {args.devices} x {args.cluster}, context {args.seq}")
    print(f"  fastest decoding   {describe(plan)}")
    print(f"  this layout holds  at most {plan.predicted.max_concurrency} sequences")
    bound_ms = 2 * plan.predicted.decode_s_per_token * 1e3
    fast = autopar.plan(graph, global_batch=8 * args.concurrency, max_token_latency_ms=bound_ms,
                        **kwargs)
    print(f"  within {bound_ms:.0f} ms/token  {describe(fast)}")
    too_many = 1 << (2 * plan.predicted.max_concurrency).bit_length()  # beyond any layout
    try:
        autopar.plan(graph, global_batch=too_many, **kwargs)
    except autopar.InfeasibleError as exc:
        print(f"  {too_many} sequences     {exc}")
    print()
    print(plan.report())


if __name__ == "__main__":
    main()
