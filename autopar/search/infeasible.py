"""The one-line InfeasibleError message: which bound stopped every candidate, what dominates
the leanest one, and the way out."""

from __future__ import annotations

from autopar.cost.hardware import Cluster
from autopar.ir.graph import Graph
from autopar.ir.summary import human
from autopar.plan.support import runtime_runs_cp
from autopar.search.space import ModelFacts, divisors


def infeasible_message(graph: Graph, facts: ModelFacts, cluster: Cluster, devices: int,
                       capacity: float, leanest: tuple | None, rejected: dict,
                       global_batch: int, reasons: set[str] | None = None,
                       host_leanest: tuple | None = None, host_capacity: float = 0.0) -> str:
    host = ""
    if host_leanest is not None:
        need, config = host_leanest
        host = (f"the leanest candidate that offloads to the host ({_mesh(config)}) keeps "
                f"{human(need, 'B')} per node there, above the node's "
                f"{human(host_capacity, 'B')} of host memory")
        if leanest is None:
            return (f"no plan fits {devices} x {cluster.name}: every candidate a device's "
                    f"{human(capacity, 'B')} holds offloads model states, and {host}; use "
                    f"more devices (the states shard over them) or nodes with more host "
                    f"memory")
    if leanest is None and rejected.get("runtime"):
        return (f"no plan for {devices} devices and global batch {global_batch} that the runtime "
                f"can run: the constraints leave only combinations it does not support "
                f"({'; '.join(sorted(reasons or ()))}); relax those constraints")
    if leanest is None:
        return (f"no legal plan for {devices} devices and global batch {global_batch}: every "
                f"mesh is ruled out by divisibility (projection sizes "
                f"{list(facts.split_dims)}, "
                f"{facts.blocks} blocks, batch per replica) or by the constraints; use a global "
                f"batch divisible by the data-parallel degree, another device count, or fewer "
                f"constraints")
    need, config, est = leanest
    where = f"the leanest candidate ({_mesh(config)}) needs {human(need, 'B')}"
    if est is not None:
        mem = est.memory
        states = mem.params + mem.grads + mem.optimizer
        parts = {"model states": states, "activations": mem.activations,
                 "buffers (logits, gathered layers, buckets)": mem.buffers}
        top = max(parts, key=parts.get)
        where += f", {human(parts[top], 'B')} of it {top}"
        if top == "model states":
            way_out = "use more devices (ZeRO-3 splits the states), offload, or a larger device"
        elif top == "activations":
            # context parallelism splits the sequence, where the engine runs it
            axes = ("pipeline, tensor- or context-parallel" if runtime_runs_cp(config.engine)
                    else "pipeline or tensor-parallel")
            way_out = (f"use a shorter sequence, more {axes} devices, or a device with more "
                       f"memory")
        else:
            way_out = "use more tensor-parallel devices, a shorter sequence or a larger device"
    else:
        biggest = max(graph.blocks, key=lambda b: b.param_bytes)
        layer = biggest.param_numel * 16  # mixed-precision Adam on one device
        tp = next((t for t in divisors(devices) if facts.tp_ok(t) and layer / t <= capacity / 2),
                  None)
        where += (f"; the largest block ({biggest.name}) alone holds {human(layer, 'B')} of "
                  f"weights, gradients and Adam states unsharded")
        way_out = (f"use at least tp={tp}, ZeRO-3, offload, or more devices" if tp and tp > 1
                   else "use more devices, offload, or a device with more memory")
    if host:  # offload is no way out: the host cannot take the states either
        where += f"; {host}"
        way_out = ("use more devices (the states shard over them) or nodes with more host "
                   "memory")
    return (f"no plan fits {human(capacity, 'B')} per device on {devices} x {cluster.name}: "
            f"{where}; {way_out}")


def _mesh(config) -> str:
    """A candidate as the message names it: mesh, ZeRO stage, full recompute, offload."""
    cp = f" cp={config.cp}" if config.cp > 1 else ""
    offload = ", offload " + "+".join(sorted(config.offload)) if config.offload else ""
    return (f"pp={config.pp} dp={config.dp}{cp} tp={config.tp} ep={config.ep}, "
            f"ZeRO-{config.zero_stage}, full recompute{offload}")
