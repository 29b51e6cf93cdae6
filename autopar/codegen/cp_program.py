"""The training program's context-parallel statements (autopar.codegen.program): the dp x cp
mesh the replicated parameters' gradients are reduced over, and the call that gives the
model its cp attention."""

from __future__ import annotations

from typing import TYPE_CHECKING

from autopar.cost.context_parallel import all_to_all_ranks
from autopar.cost.hardware import load_cluster

if TYPE_CHECKING:
    from autopar.plan import Plan

# the mesh axes, outermost first (tp innermost, as the cost model); a program's mesh holds
# those in use
CP_AXES = ("pp", "dp", "cp", "ep", "tp")
# the flattened dp x cp axis: the ranks holding the same parameters (torchtitan's dp_shard_cp)
DP_CP = "dp_cp"


def dp_axis(plan: Plan) -> str:
    """The mesh axis the data-parallel wrapper reduces gradients over: dp, cp (dp of one
    rank), or both flattened (dp x cp)."""
    if plan.mesh.get("cp", 1) == 1:
        return "dp"
    return DP_CP if plan.mesh["dp"] > 1 else "cp"


def context_parallel_mesh(w) -> None:
    """The ``build_mesh`` line of a program with dp > 1 and cp > 1 (``w``: its writer) that
    flattens dp x cp into one axis."""
    w.line(f"    mesh[\"dp\", \"cp\"]._flatten(\"{DP_CP}\")  # the replicated parameters' "
           "gradients: over dp x cp")


def context_parallel_statements(w, plan: Plan) -> None:
    """The ``parallelize`` lines that give the model its context-parallel attention."""
    w.line(f"    # context parallelism over mesh[\"cp\"] ({plan.mesh['cp']} ranks, {plan.cp_mode}): "
           "each rank holds chunks i and 2cp-1-i of")
    w.line("    # every sequence; attention sees the whole sequence, global position ids feed "
           "the rotary tables")
    if plan.cp_mode == "hybrid":  # the cost model's split: the cp ranks of one node
        cluster = load_cluster(plan.cluster)
        a2a = all_to_all_ranks(plan.mesh["cp"], "hybrid", plan.mesh["tp"], plan.mesh["ep"],
                               cluster.devices_per_node)
        w.line(f"    # hybrid: all-to-all inside groups of {a2a} cp ranks (one node's), a ring "
               f"across the groups")
        w.line(f"    ap.context_parallel(model, mesh, plan.cp_mode, all_to_all_ranks={a2a})")
    else:
        w.line("    ap.context_parallel(model, mesh, plan.cp_mode)")
