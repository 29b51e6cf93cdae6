"""The choice a plan records, as the cost model's ParallelConfig: to price that same plan again
under another cluster description (a recalibrated profile) without searching again.

Everything but the tensor-parallel layout is a plan field. The layout is read back from the
plan's ``placements.nodes_by_block_type`` (each block type's column, row, split and
kv-replicated ops, by name in that type's first block).
"""

from __future__ import annotations

from autopar.cost.config import BlockLayout, ParallelConfig, TPLayouts
from autopar.cost.precision import Precision
from autopar.errors import PlanError
from autopar.ir.graph import Graph
from autopar.plan import Plan
from autopar.search.sharding import kv_projections


def plan_config(plan: Plan, graph: Graph) -> ParallelConfig:
    """The ParallelConfig ``plan`` was predicted with, for ``graph`` (the plan's model,
    captured as the plan was)."""
    recorded = set(plan.placements.get("params", {}))
    if len(graph.blocks) != len(plan.recompute) or (recorded and recorded != set(graph.params)):
        raise PlanError("the graph's blocks or parameters are not the plan's: capture the "
                        "model the plan was made for")
    precision = Precision.from_dict(plan.precision) if plan.precision else None
    return ParallelConfig(
        dp=plan.mesh["dp"], tp=plan.mesh["tp"], pp=plan.mesh["pp"], ep=plan.mesh["ep"],
        cp=plan.mesh.get("cp", 1), cp_mode=plan.cp_mode,
        sequence_parallel=plan.sequence_parallel, zero_stage=plan.zero_stage,
        microbatch_size=plan.microbatch_size, num_microbatches=plan.num_microbatches,
        schedule=plan.schedule, virtual_stages=plan.virtual_stages,
        recompute=tuple(plan.recompute), offload=frozenset(plan.offload),
        stages=tuple(tuple(s) for s in plan.stages), precision=precision, engine=plan.engine,
        tp_layouts=recorded_layouts(plan, graph),
        vocab_parallel=bool(plan.model.get("vocab_parallel", True)),
        capacity_factor=plan.capacity_factor)


def recorded_layouts(plan: Plan, graph: Graph) -> TPLayouts | None:
    """The tensor-parallel layout per block type the plan records (None without tp)."""
    tp = plan.mesh["tp"]
    if tp <= 1:
        return None
    recorded = plan.placements.get("nodes_by_block_type", {})
    by_type = []
    for type_id in sorted({b.type_id for b in graph.blocks}):
        block = next(b for b in graph.blocks if b.type_id == type_id)
        roles = recorded.get(str(type_id), {})
        position = {name: i for i, name in enumerate(block.nodes)}
        unknown = set(roles) - set(position)
        if unknown:
            raise PlanError(f"the plan's layout names ops the graph lacks (e.g. "
                            f"{sorted(unknown)[0]}): capture the model the plan was made for")
        kv = kv_projections(graph, block, tp)
        of = {role: tuple(sorted(position[n] for n, r in roles.items() if r == role))
              for role in ("column", "row", "split")}
        by_type.append((type_id, BlockLayout(
            column=of["column"], row=of["row"], sharded=of["split"],
            kv=tuple(sorted((position[n], kv.get(n, 1)) for n, r in roles.items()
                            if r == "kv-replicated")))))
    return TPLayouts(tp=tp, by_type=tuple(by_type))
