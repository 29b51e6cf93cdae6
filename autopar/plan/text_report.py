"""A plain-text rendering of a Plan (the full report with markdown/HTML is issue 6's)."""

from __future__ import annotations

from autopar.ir.summary import human


def render(plan, fmt: str = "text") -> str:
    if fmt != "text":
        from autopar.errors import PlanError

        raise PlanError(f"report format {fmt!r} is not available yet; use 'text'")
    p = plan.predicted
    mem = p.memory
    m = plan.mesh
    modes = {mode: plan.recompute.count(mode) for mode in ("none", "selective", "full")
             if plan.recompute.count(mode)}
    lines = [
        f"plan for {plan.model.get('model_type', plan.model.get('source'))} "
        f"({plan.model['params']:,} params), {plan.task} on {plan.devices} x {plan.cluster}",
        f"  mesh          pp={m['pp']} dp={m['dp']} tp={m['tp']} ep={m['ep']}"
        f"{'  (sequence parallel)' if plan.sequence_parallel else ''}",
        f"  batching      global {plan.global_batch} = dp*ep {m['dp'] * m['ep']} x micro-batch "
        f"{plan.microbatch_size} x {plan.num_microbatches} micro-batches",
        f"  schedule      {plan.schedule}"
        f"{f' (v={plan.virtual_stages})' if plan.virtual_stages > 1 else ''}, "
        f"ZeRO-{plan.zero_stage}, recompute {modes}, offload {plan.offload or 'none'}",
        f"  step time     {p.step_time_s:.4g} s (bubble {p.bubble_s:.3g} s), "
        f"{human(p.tokens_per_s)} tokens/s, MFU {p.mfu:.1%}",
        f"  memory        {human(mem['total'], 'B')} of {human(plan.memory_limit_bytes, 'B')} on "
        f"the busiest device: params {human(mem['params'], 'B')}, grads "
        f"{human(mem['grads'], 'B')}, optimizer {human(mem['optimizer'], 'B')}, activations "
        f"{human(mem['activations'], 'B')}, kv cache {human(mem['kv_cache'], 'B')}, buffers "
        f"{human(mem['buffers'], 'B')}",
        f"  solver        gap {plan.solver.get('gap', 0):.2%} (bound "
        f"{plan.solver.get('bound_s', 0):.4g} s), {plan.solver.get('evaluated', 0)} evaluated, "
        f"{plan.solver.get('pruned_by_bound', 0)} pruned by bound, rejected "
        f"{plan.solver.get('rejected', {})}",
    ]
    if plan.alternatives:
        lines.append("  runner-ups")
        for a in plan.alternatives:
            am = a["mesh"]
            lines.append(
                f"    pp={am['pp']} dp={am['dp']} tp={am['tp']} ep={am['ep']} ZeRO-"
                f"{a['zero_stage']} {a['schedule']} mb={a['microbatch_size']}x"
                f"{a['num_microbatches']} offload {a['offload'] or 'none'}: "
                f"{a['step_time_s']:.4g} s (+{a['slower']:.1%}), "
                f"{human(a['memory_total'], 'B')}")
    return "\n".join(lines)
