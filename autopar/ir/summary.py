"""A human summary of a captured graph (what ``autopar inspect`` prints)."""

from __future__ import annotations

from autopar.ir.graph import Graph


def human(n: float, unit: str = "") -> str:
    """1234567 -> '1.23 M'; keeps three significant figures."""
    for scale, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {suffix}{unit}"
    return f"{n:.3g} {unit}".rstrip()


def summary_dict(graph: Graph, top: int = 5) -> dict:
    """Machine-readable summary; the text form is rendered from this."""
    types = []
    for type_id, blocks in graph.block_types().items():
        b = blocks[0]
        types.append({
            "type_id": type_id, "kind": b.kind, "role": b.role, "count": len(blocks),
            "first": b.name, "ops": len(b.nodes), "params_per_block": b.param_numel,
            "flops_per_block": b.flops,
        })
    largest = sorted(graph.params.values(), key=lambda p: p.nbytes, reverse=True)[:top]
    return {
        "source": graph.source,
        "ops": len(graph.ops),
        "inputs": {i.name: list(i.meta.shape) for i in graph.inputs},
        "params": graph.num_params,
        "param_bytes": graph.param_bytes,
        "tokens": graph.tokens,
        "forward_flops": graph.flops,
        "forward_flops_per_token": graph.flops_per_token,
        "flops_by_kind": graph.flops_by_kind(),
        "blocks": len(graph.blocks),
        "block_types": types,
        "largest_tensors": [{"name": p.fqn, "shape": list(p.shape), "dtype": p.dtype,
                             "bytes": p.nbytes} for p in largest],
    }


def summary_text(graph: Graph, title: str = "model") -> str:
    d = summary_dict(graph)
    lines = [
        f"{title}: captured by {d['source']}, {d['ops']} ops",
        f"  inputs      {', '.join(f'{k} {v}' for k, v in d['inputs'].items())}",
        f"  parameters  {d['params']:,} ({human(d['param_bytes'], 'B')})",
        f"  forward     {human(d['forward_flops'], 'FLOP')} for {d['tokens']:,} tokens "
        f"= {human(d['forward_flops_per_token'], 'FLOP')}/token",
        "  by kind     " + ", ".join(f"{k} {100 * v / max(d['forward_flops'], 1):.1f}%"
                                     for k, v in sorted(d["flops_by_kind"].items(),
                                                        key=lambda kv: -kv[1]) if v),
        f"  blocks      {d['blocks']} in {len(d['block_types'])} types",
    ]
    for t in d["block_types"]:
        lines.append(
            f"    type {t['type_id']}: {t['count']} x {t['kind']:<11} ({t['role']}, e.g. "
            f"{t['first']}): {t['ops']} ops, {human(t['params_per_block'])} params, "
            f"{human(t['flops_per_block'], 'FLOP')}"
        )
    lines.append("  largest tensors")
    for t in d["largest_tensors"]:
        lines.append(f"    {t['name']:<48} {str(tuple(t['shape'])):<18} {t['dtype']:<9} "
                     f"{human(t['bytes'], 'B')}")
    return "\n".join(lines)
