"""What a Plan records beyond the decision, so that report, diff and explain need no recapture.

Everything here is read off the search's result and the cost model at planning time: the step
time broken into terms that add up to it, per-stage time and memory, the runner-ups' numbers,
which bound held the choice back, and per block type the alternatives (tensor-parallel
degrees, recompute modes, each op's sharding strategies) with their costs.
"""

from __future__ import annotations

from dataclasses import replace

from autopar.cost.block_cost import cached_block_cost
from autopar.cost.comm import p2p_time
from autopar.cost.config import ParallelConfig, TPLayouts
from autopar.cost.estimate import Estimate, p2p_hidden_share
from autopar.cost.hardware import Cluster
from autopar.cost.tp_layout import broadcast_split, tp_layout
from autopar.ir.graph import Graph
from autopar.plan.plan import Predicted, round6
from autopar.search.recompute import MODES
from autopar.search.robust import sensitivity
from autopar.search.sharding import STRATEGY_NAMES, node_options
from autopar.search.space import ModelFacts, divisors, tp_tiles_nodes


def _rounded(d: dict[str, float]) -> dict[str, float]:
    return {k: round6(v) for k, v in d.items()}


def _stage_recompute_s(graph: Graph, cluster: Cluster, config: ParallelConfig, task: str,
                       start: int, end: int) -> float:
    if task == "infer":
        return 0.0
    return sum(cached_block_cost(graph, i, config, cluster, config.recompute_of(i)).recompute_s
               for i in range(start, end))


def breakdown(graph: Graph, cluster: Cluster, config: ParallelConfig, est: Estimate,
              task: str) -> dict[str, float]:
    """The step time as terms that add up to it, along the bottleneck stage's critical path.

    compute and recompute and tp/ep communication are that stage's ``m`` micro-batches; bubble
    is the schedule's fill and drain (with the point-to-point sends); dp_comm is what data
    parallelism adds to those micro-batches (exposed collectives, compute slowed beside them)
    plus its once-per-step collectives; optimizer and offload are the slowest stage tail's.
    """
    m = config.num_microbatches
    if task == "infer":
        return _decode_breakdown(est, m)
    k = max(range(len(est.stages)), key=lambda i: est.stages[i].fwd_s + est.stages[i].bwd_s)
    stage = est.stages[k]
    tail = max(est.stages, key=lambda s: s.tail_s)
    recompute = _stage_recompute_s(graph, cluster, config, task, *stage.blocks)
    return _rounded({
        "compute_s": m * (stage.compute_s - recompute), "recompute_s": m * recompute,
        "comm_s": m * stage.comm_s, "bubble_s": est.bubble_s,
        "dp_comm_s": m * stage.dp_microbatch_s + tail.dp_exposed_s,
        "optimizer_s": tail.optimizer_s, "offload_s": tail.offload_s,
    })


def _decode_breakdown(est: Estimate, m: int) -> dict[str, float]:
    """A decoding step as terms that add up to it: when one token's trip through the stages
    sets the pace, every stage's compute and collectives plus the hand-offs between them
    (as bubble); when the busiest stage does, its ``m`` micro-batches."""
    terms = dict.fromkeys(("compute_s", "recompute_s", "comm_s", "bubble_s", "dp_comm_s",
                           "optimizer_s", "offload_s"), 0.0)
    if est.bubble_s > 0:
        terms["compute_s"] = sum(s.compute_s for s in est.stages)
        terms["comm_s"] = sum(s.comm_s for s in est.stages)
        terms["bubble_s"] = est.step_time_s - terms["compute_s"] - terms["comm_s"]
    else:
        stage = max(est.stages, key=lambda s: s.fwd_s)
        terms["compute_s"] = m * stage.compute_s
        terms["comm_s"] = m * stage.comm_s
    return _rounded(terms)


def _p2p_s(graph: Graph, cluster: Cluster, config: ParallelConfig, est: Estimate) -> float:
    """The slowest stage boundary's send (what the cost model puts on the fill and drain)."""
    sends = [cached_block_cost(graph, s.blocks[1] - 1, config, cluster,
                               config.recompute_of(s.blocks[1] - 1)).output_bytes
             for s in est.stages[:-1]]
    return max((p2p_time(b, config, cluster) for b in sends), default=0.0)


def predicted(graph: Graph, cluster: Cluster, config: ParallelConfig, est: Estimate,
              task: str, checks: dict[str, float] | None = None) -> Predicted:
    """The cost model's prediction, with per-stage time (incl. idle) and memory by kind, and
    the step under the robustness checks (computed here when not given)."""
    if checks is None:
        checks = sensitivity(graph, cluster, config, task)
    m = config.num_microbatches
    pipeline = m * max(s.fwd_s + s.bwd_s for s in est.stages) + est.bubble_s
    # steady-state sends keep a stage busy, not idle: what they cost is not its bubble
    hidden = p2p_hidden_share(config, cluster)
    p2p = _p2p_s(graph, cluster, config, est)
    steady_send = p2p * ((1 - hidden) + hidden * cluster.device.overlap.compute_slowdown)
    chunks = config.virtual_stages if config.schedule == "interleaved" else 1
    busy_sending = 2 * chunks * m * steady_send if config.pp > 1 else 0.0
    stages = []
    for s in est.stages:
        stages.append({
            "blocks": list(s.blocks), "fwd_s": round6(s.fwd_s), "bwd_s": round6(s.bwd_s),
            "compute_s": round6(s.compute_s), "comm_s": round6(s.comm_s),
            "dp_comm_s": round6(s.dp_comm_s), "dp_exposed_s": round6(s.dp_exposed_s),
            "memory": _rounded(s.memory.as_dict()),
            "recompute_s": round6(_stage_recompute_s(graph, cluster, config, task, *s.blocks)),
            "weight_grad_s": round6(s.weight_grad_s),
            # idle time of this stage within the pipelined forward/backward of one step
            "bubble_s": round6(max(pipeline - m * (s.fwd_s + s.bwd_s) - busy_sending, 0.0)),
            "offload_s": round6(s.offload_s), "host_bytes": round6(s.host_bytes),
            "optimizer_s": round6(s.optimizer_s),
            # what data parallelism adds to each micro-batch (exposed collectives and compute
            # slowed beside them)
            "dp_microbatch_s": round6(s.dp_microbatch_s),
        })
    return Predicted(
        step_time_s=round6(est.step_time_s), memory=_rounded(est.memory.as_dict()),
        mfu=round6(est.mfu), tokens_per_s=round6(est.tokens_per_s), bubble_s=round6(est.bubble_s),
        host_bytes_per_node=round6(est.host_bytes_per_node), stages=stages,
        breakdown=breakdown(graph, cluster, config, est, task),
        pipeline_s=round6(pipeline), p2p_s=round6(p2p), p2p_steady_s=round6(steady_send),
        optimizer_s=round6(est.optimizer_s), offload_s=round6(est.offload_s),
        model_flops=round6(est.model_flops), sensitivity=_rounded(checks),
        **({"prefill_s": round6(est.prefill_s), "decode_s_per_token": round6(est.step_time_s),
            "context": est.context, "kv_cache_bytes": round6(est.memory.kv_cache)}
           if task == "infer" else {}))


def runner_up(graph: Graph, cluster: Cluster, config: ParallelConfig, est: Estimate,
              best: Estimate, task: str) -> dict:
    """One runner-up plan: its choice, how much slower and larger than the chosen one, and its
    step under the robustness checks (a faster runner-up lost on those)."""
    if isinstance(config.recompute, str):
        per_block = [config.recompute] * len(graph.blocks)
    else:
        per_block = list(config.recompute)
    return {
        "mesh": {"pp": config.pp, "dp": config.dp, "cp": config.cp, "ep": config.ep,
                 "tp": config.tp},
        **({"cp_mode": config.cp_mode} if config.cp > 1 else {}),  # how cp ranks exchange K/V
        "microbatch_size": config.microbatch_size, "num_microbatches": config.num_microbatches,
        "zero_stage": config.zero_stage, "schedule": config.schedule,
        "virtual_stages": config.virtual_stages,
        "sequence_parallel": config.sequence_parallel, "recompute": sorted(set(per_block)),
        "recompute_blocks": {m: per_block.count(m) for m in MODES if per_block.count(m)},
        "offload": sorted(config.offload), "step_time_s": round6(est.step_time_s),
        "memory_total": round6(est.memory.total),
        "slower": round6((est.step_time_s - best.step_time_s) / best.step_time_s),
        "larger": round6((est.memory.total - best.memory.total) / best.memory.total),
        "mfu": round6(est.mfu), "tokens_per_s": round6(est.tokens_per_s),
        "memory": _rounded(est.memory.as_dict()),
        "breakdown": breakdown(graph, cluster, config, est, task),
        "sensitivity": _rounded(sensitivity(graph, cluster, config, task)),
    }


def _exclusion(facts: ModelFacts, tp: int, pp: int, dp: int, ep: int, global_batch: int,
               devices_per_node: int, cross_node: bool, pins: dict) -> tuple[str, str] | None:
    """(bound, reason) that rules a mesh out before costing, or None when it is legal."""
    if not facts.tp_ok(tp):
        return "divisibility", (f"tp={tp} does not divide the projection sizes "
                                f"{list(facts.split_dims)}")
    if not facts.ep_ok(ep):
        return "divisibility", f"ep={ep} does not divide {facts.experts} experts"
    if pp > facts.blocks:
        return "divisibility", f"pp={pp} exceeds the {facts.blocks} blocks"
    if global_batch % (dp * ep):
        return "batch", f"dp*ep={dp * ep} does not divide the global batch {global_batch}"
    if not tp_tiles_nodes(tp, devices_per_node):
        return "topology", (f"tp={tp} groups would straddle nodes of {devices_per_node} "
                            f"devices")
    if tp > devices_per_node and not cross_node:
        return "topology", (f"tp={tp} spans nodes of {devices_per_node} devices (tried only "
                            f"when nothing fits inside a node)")
    mesh = {"pp": pp, "dp": dp, "tp": tp, "ep": ep}
    pinned = {k: v for k, v in pins.items() if k in mesh and mesh[k] != v}
    if pinned:
        return "constraints", ", ".join(f"{k}={v} pinned" for k, v in sorted(pinned.items()))
    return None


def bounds(facts: ModelFacts, cluster: Cluster, devices: int, global_batch: int, pins: dict,
           config: ParallelConfig, est: Estimate, capacity: float, rejected: dict[str, int],
           memory_rejected_bounds: list[float]) -> dict:
    """Which bound held the choice back: memory, batch, divisibility, topology, constraints.

    Memory binds when a candidate whose lower bound beats the chosen step did not fit, or
    when the chosen plan recomputes or offloads (it would be faster without). Meshes ruled
    out before costing are counted by reason; batch and divisibility bind when they ruled
    out meshes that the plan had reason to want (pure data parallelism; a wider tp while
    memory binds) or the batch leaves a pipeline no more micro-batches.
    """
    per_node = cluster.devices_per_node
    cross_node = config.tp > per_node
    excluded: dict[str, dict] = {k: {"excluded_meshes": 0, "examples": []}
                                 for k in ("divisibility", "batch", "topology", "constraints")}
    blocked_tp: set[int] = set()
    cp = config.cp  # pinned or 1: the meshes searched are those of this context parallelism
    for tp in divisors(devices // cp):
        for pp in divisors(devices // (tp * cp)):
            for ep in divisors(devices // (tp * pp * cp)):
                if ep > 1 and not facts.experts:
                    continue  # not an option for a dense model at all
                dp = devices // (tp * pp * ep * cp)
                why = _exclusion(facts, tp, pp, dp, ep, global_batch, per_node, cross_node,
                                 pins)
                if why is None:
                    continue
                entry = excluded[why[0]]
                entry["excluded_meshes"] += 1
                if why[0] == "divisibility" and not facts.tp_ok(tp):
                    blocked_tp.add(tp)
                if len(entry["examples"]) < 3 and why[1] not in entry["examples"]:
                    entry["examples"].append(why[1])
    pinned_recompute = "recompute" in pins
    modes = [config.recompute_of(i) for i in range(est.stages[-1].blocks[1])]
    faster = [b for b in memory_rejected_bounds if b < est.step_time_s]
    memory = {
        "used_bytes": round6(est.memory.total), "limit_bytes": round6(capacity),
        # device or host memory: faster_rejected counts both, so this does too
        "rejected": rejected.get("memory", 0) + rejected.get("host memory", 0),
        "faster_rejected": len(faster),
        "best_rejected_bound_s": round6(min(faster)) if faster else None,
        "recompute_blocks": 0 if pinned_recompute else sum(m != "none" for m in modes),
        "offload": [] if "offload" in pins else sorted(config.offload),
    }
    memory["binding"] = bool(faster or memory["recompute_blocks"] or memory["offload"])
    pure_dp_blocked = excluded["batch"]["excluded_meshes"] > 0 and config.dp * config.ep < devices
    batch_limits_pipeline = config.pp > 1 and config.microbatch_size == 1
    excluded["batch"]["binding"] = pure_dp_blocked or batch_limits_pipeline
    excluded["batch"]["num_microbatches"] = config.num_microbatches
    excluded["divisibility"]["binding"] = memory["binding"] and any(
        config.tp < t <= per_node for t in blocked_tp)
    excluded["topology"]["binding"] = False  # a cross-node tp is tried whenever nothing fits
    excluded["constraints"]["binding"] = bool(pins)
    excluded["constraints"]["pinned"] = {k: _plain(v)
                                         for k, v in sorted(pins.items())}
    return {"memory": memory, **excluded}


def _plain(value: object) -> object:
    """A pin as plain YAML data: tuples (stages, recompute lists) as lists."""
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return value


def explain(graph: Graph, cluster: Cluster, config: ParallelConfig, tps: list[int],
            layouts: dict[int, TPLayouts] | None = None) -> dict:
    """Per block type: cost at every tensor-parallel degree searched, per recompute mode, and
    per op the chosen sharding strategy and every legal one's seconds at the plan's degree."""
    out: dict[str, dict] = {}
    for type_id, blocks in graph.block_types().items():
        block = blocks[0]
        by_tp = {}
        for t in sorted({1, *tps}):
            cfg = replace(config, tp=t, sequence_parallel=config.sequence_parallel and t > 1,
                          tp_layouts=(layouts or {}).get(t))
            try:
                c = cached_block_cost(graph, block.index, cfg, cluster, "none")
            except ValueError:  # the plan's all-to-all cp cannot split this degree's heads
                continue
            by_tp[str(t)] = _rounded({
                "fwd_s": c.fwd_s, "bwd_s": c.bwd_s, "comm_s": c.tp_comm_s + c.ep_comm_s,
                "params": c.dense_params + c.expert_params,
                "activation_bytes": c.activation_bytes})
        by_mode = {}
        for mode in MODES:
            c = cached_block_cost(graph, block.index, config, cluster, mode)
            by_mode[mode] = _rounded({"activation_bytes": c.activation_bytes,
                                      "peak_bytes": c.recompute_peak_bytes,
                                      "recompute_s": c.recompute_s})
        layout = tp_layout(graph, block, config.tp_layouts)
        chosen_of = {}
        if config.tp > 1:
            chosen_of = {**{n: "S" for n in layout.sharded}, **{n: "C" for n in layout.column},
                         **{n: "W" for n in layout.row}, **{n: "G" for n in layout.kv},
                         **{n: "B" for n in layout.sharded if broadcast_split(graph, n)
                            and graph.op(n).inputs[0] not in layout.sharded}}
        prefix = block.name + "."
        nodes = {}
        for name, costs in node_options(graph, block, config.tp, cluster,
                                        config.precision.compute).items():
            op = graph.op(name)
            module = op.module_path
            nodes[name] = {"module": module[len(prefix):] if module.startswith(prefix)
                           else module, "kind": op.kind.value,
                           "chosen": STRATEGY_NAMES[chosen_of.get(name, "R")],
                           **_rounded(costs)}
        out[str(type_id)] = {"kind": block.kind, "first": block.name, "count": len(blocks),
                             "tp": by_tp, "recompute": by_mode, "nodes": nodes}
    return {"tp": config.tp, "block_types": out}
