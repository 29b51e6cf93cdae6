"""``autopar explain``: for a block or an op, the chosen sharding, the alternatives, their costs.

Reads the ``explain`` section the search recorded in the plan: per block type, the block's
cost at every tensor-parallel degree searched and under every recompute mode, and per op of
the type's first block, every legal sharding strategy's seconds at the plan's degree.
"""

from __future__ import annotations

import json

from autopar.errors import PlanError
from autopar.plan import Plan
from autopar.report import fmt
from autopar.report.text import text_table

STRATEGY_MEANING = {
    "replicate": "every tp rank computes the whole op",
    "column": "output features split over tp (column parallel); the input's gradient is "
              "all-reduced in the backward",
    "row": "input features split over tp (row parallel); the output is all-reduced in the "
           "forward",
    "split": "works on tp-split data (heads or features) with no communication",
}
_INTERESTING = ("linear", "attention", "matmul", "moe_expert", "moe_router", "embedding")
_SHARED_NOTE = ("a column-parallel op's time includes the backward all-reduce of its input, "
                "paid once by all column-parallel readers of that input (q, k, v share one); "
                "the solver picks the cheapest legal combination for the block, where a split "
                "value may flow only into ops that take split input")
_HAS_PARAMS = ("linear", "embedding", "norm", "moe_expert", "moe_router")


def _needs_explain(plan: Plan) -> dict:
    ex = plan.explain
    if not ex or "block_types" not in ex:
        raise PlanError("this plan file has no explain data (written by an older autopar); "
                        "re-run `autopar compile` to record it")
    return ex


def _find_block(plan: Plan, key: str) -> int:
    blocks = plan.model.get("blocks", [])
    if key.lstrip("-").isdigit():
        index = int(key)
        if 0 <= index < len(blocks):
            return index
    for i, b in enumerate(blocks):
        if b["name"] == key:
            return i
    names = f"{blocks[0]['name']} .. {blocks[-1]['name']}" if blocks else "none"
    raise PlanError(f"no block {key!r} in this plan: it has {len(blocks)} blocks, indices "
                    f"0-{len(blocks) - 1} ({names}); pass an index or a block name")


def _stage_of(plan: Plan, index: int) -> int:
    return next((k for k, (s, e) in enumerate(plan.stages) if s <= index < e), 0)


def block_explain(plan: Plan, key: str) -> dict:
    """A block's stage, recompute (chosen and alternatives), tp degrees and per-op sharding."""
    index = _find_block(plan, key)
    ex = _needs_explain(plan)
    block = plan.model["blocks"][index]
    t = ex["block_types"][str(block["type"])]
    if not plan.model.blocks[index].is_layer:  # no module of its own: its ops' modules
        prefixes = tuple(f"{v['module']}." for v in t["nodes"].values()
                         if v["kind"] in _HAS_PARAMS and v["module"])
    else:
        prefixes = (block["name"] + ".",)
    params = {k: v for k, v in plan.placements.get("params", {}).items()
              if k.startswith(prefixes)}
    ops = [{"node": n, **v} for n, v in t["nodes"].items() if v["kind"] in _INTERESTING]
    others: dict[str, int] = {}
    for v in t["nodes"].values():
        if v["kind"] not in _INTERESTING:
            others[v["chosen"]] = others.get(v["chosen"], 0) + 1
    return {"block": index, "name": block["name"], "type": block["type"],
            "kind": block["kind"], "stage": _stage_of(plan, index), "tp": ex["tp"],
            "recompute": plan.recompute[index], "recompute_options": t["recompute"],
            "tp_options": t["tp"], "ops": ops, "other_ops": others,
            "same_type_blocks": t["count"], "params": params}


def node_explain(plan: Plan, name: str) -> dict:
    """Every op matching ``name``: a node name of a block type's first block, a module path
    (absolute, in any block), or a path relative to its block (``self_attn.q_proj``)."""
    ex = _needs_explain(plan)
    blocks = plan.model.get("blocks", [])
    matches = []
    for type_id, t in ex["block_types"].items():
        firsts = [b.name for b in plan.model.blocks if str(b.type) == type_id and b.is_layer]
        for node, v in t["nodes"].items():
            module = v["module"]
            absolute = {f"{b}.{module}" for b in firsts}
            if name in (node, module) or name in absolute:
                matches.append({"node": node, "type": int(type_id), "first": t["first"], **v})
    if not matches:
        raise PlanError(f"no op or module {name!r} in this plan; `autopar explain PLAN --block "
                        f"K` lists a block's ops and modules")
    params = {k: v for k, v in plan.placements.get("params", {}).items()
              if any(k.startswith(f"{b['name']}.{name}.") or k.startswith(f"{name}.")
                     for b in blocks)}
    return {"query": name, "tp": ex["tp"], "matches": matches, "params": params}


def overview(plan: Plan) -> dict:
    """Per block type: count, chosen recompute, how many ops each strategy got."""
    ex = plan.explain.get("block_types", {}) if plan.explain else {}
    out = []
    for b in plan.model.get("blocks", []):
        if any(o["type"] == b["type"] for o in out):
            continue
        modes = [m for blk, m in zip(plan.model["blocks"], plan.recompute, strict=False)
                 if blk["type"] == b["type"]]
        nodes = ex.get(str(b["type"]), {}).get("nodes", {})
        strategies: dict[str, int] = {}
        for v in nodes.values():
            strategies[v["chosen"]] = strategies.get(v["chosen"], 0) + 1
        out.append({"type": b["type"], "kind": b["kind"], "first": b["name"],
                    "count": len(modes), "recompute": {m: modes.count(m) for m in set(modes)},
                    "strategies": strategies})
    return {"tp": plan.mesh["tp"], "block_types": out}


def _options(costs: dict, chosen: str) -> list[list[str]]:
    base = costs[chosen]
    rows = []
    for s in ("replicate", "column", "row", "split"):
        if s in costs:
            rel = "chosen" if s == chosen else (fmt.pct((costs[s] - base) / base, signed=True)
                                                if base else fmt.delta_seconds(costs[s]))
            rows.append([s, fmt.seconds(costs[s]), rel, STRATEGY_MEANING[s]])
    return rows


def render_explain(d: dict, fmt_: str = "text") -> str:
    """Text (or JSON) of a block, node or overview explanation."""
    if fmt_ == "json":
        return json.dumps(d, indent=2) + "\n"
    lines: list[str] = []
    if "matches" in d:
        for m in d["matches"]:
            lines += [f"op {m['node']} ({m['kind']}, module {m['module']}) in block type "
                      f"{m['type']} (first: {m['first']}): {m['chosen']} at tp={d['tp']}",
                      "  strategies, forward + backward seconds for one captured sequence:"]
            costs = {k: v for k, v in m.items() if k in STRATEGY_MEANING}
            lines += text_table(["strategy", "time", "vs chosen", "meaning"],
                                _options(costs, m["chosen"]), {1, 2}, indent="    ")
        if d["tp"] > 1:
            lines.append(_SHARED_NOTE)
        else:
            lines.append("the plan has tp=1, so no op is sharded; `--block` shows the block's "
                         "cost at every tensor-parallel degree searched")
        if d["params"]:
            shown = list(d["params"].items())[:8]
            more = f" (and {len(d['params']) - 8} more)" if len(d["params"]) > 8 else ""
            lines.append("parameters: " + ", ".join(f"{k} {v}" for k, v in shown) + more)
        return "\n".join(lines).rstrip() + "\n"
    if "block" in d:
        lines.append(f"block {d['block']} {d['name']} ({d['kind']}, type {d['type']}, one of "
                     f"{d['same_type_blocks']}), pipeline stage {d['stage']}")
        lines.append(f"  recompute: {d['recompute']}; per micro-batch:")
        rows = [[m, fmt.nbytes(v["activation_bytes"]), fmt.nbytes(v["peak_bytes"]),
                 fmt.seconds(v["recompute_s"]), "chosen" if m == d["recompute"] else ""]
                for m, v in d["recompute_options"].items()]
        lines += text_table(["mode", "stored activations", "backward peak", "extra time", ""],
                            rows, {1, 2, 3}, indent="    ")
        lines.append(f"  tensor parallel: tp={d['tp']}; this block per micro-batch at each "
                     f"degree searched:")
        rows = [[t, fmt.seconds(v["fwd_s"]), fmt.seconds(v["bwd_s"]), fmt.seconds(v["comm_s"]),
                 fmt.count(v["params"]), fmt.nbytes(v["activation_bytes"]),
                 "chosen" if int(t) == d["tp"] else ""] for t, v in d["tp_options"].items()]
        lines += text_table(["tp", "forward", "backward", "tp comm", "params/device",
                             "activations", ""], rows, {1, 2, 3, 4, 5}, indent="    ")
        others = ", ".join(f"{v} {k}" for k, v in sorted(d["other_ops"].items())) or "none"
        lines.append(f"  sharding of its ops at tp={d['tp']}, forward + backward for one "
                     f"captured sequence (other ops: {others}):")
        rows = []
        for op in d["ops"]:
            costs = {k: v for k, v in op.items() if k in STRATEGY_MEANING}
            alts = ", ".join(f"{s} {fmt.seconds(c)}" for s, c in costs.items()
                             if s != op["chosen"])
            rows.append([op["node"], op["module"], op["kind"], op["chosen"],
                         fmt.seconds(costs[op["chosen"]]), alts or "-"])
        lines += text_table(["op", "module", "kind", "chosen", "time", "alternatives"], rows,
                            {4}, indent="    ")
        if d["tp"] > 1:
            lines += [f"  {_SHARED_NOTE}"]
        if d["params"]:
            lines.append("  parameters:")
            lines += text_table([], [[k, v] for k, v in d["params"].items()], indent="    ")
        return "\n".join(lines) + "\n"
    lines.append(f"block types at tp={d['tp']} (`--block K` for one block, `--node NAME` for "
                 f"one op):")
    rows = [[str(t["type"]), t["kind"], str(t["count"]), t["first"],
             fmt.recompute_counts(t["recompute"]),
             ", ".join(f"{k} {v}" for k, v in sorted(t["strategies"].items())) or "-"]
            for t in d["block_types"]]
    lines += text_table(["type", "kind", "count", "first", "recompute", "ops by strategy"],
                        rows, {2})
    return "\n".join(lines) + "\n"
