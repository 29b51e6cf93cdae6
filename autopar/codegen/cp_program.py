"""The training program's context-parallel statements (autopar.codegen.program): the dp x cp
mesh the replicated parameters' gradients are reduced over, and the call that gives the
model its cp attention."""

from __future__ import annotations

from typing import TYPE_CHECKING

from autopar.cost.context_parallel import all_to_all_ranks
from autopar.cost.hardware import load_cluster
from autopar.errors import PlanError

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


def hybrid_split(plan: Plan) -> int:
    """The all-to-all group size of a hybrid plan: the cost model's, the cp ranks of one node
    (1 or every cp rank: it runs as the ring or the all-to-all, as priced). A size that does
    not divide cp is a one-line PlanError."""
    cp = plan.mesh["cp"]
    # an int whatever the catalog (or a profile) wrote: it is written into the program
    a2a = int(all_to_all_ranks(cp, "hybrid", plan.mesh["tp"], plan.mesh["ep"],
                               int(load_cluster(plan.cluster).devices_per_node)))
    if cp % a2a:
        raise PlanError(f"cp_mode=hybrid puts the {a2a} cp ranks of a node in one all-to-all "
                        f"group, which does not divide cp={cp}; re-plan with cp_mode=ring or "
                        f"a cp that {a2a} divides")
    return a2a


def context_parallel_statements(w, plan: Plan, stage: bool = False) -> None:
    """The ``parallelize`` (``stage``: ``parallelize_stage``) lines that give the model (the
    traced stage) its context-parallel attention."""
    w.line(f"    # context parallelism over mesh[\"cp\"] ({plan.mesh['cp']} ranks, {plan.cp_mode}): "
           "each rank holds chunks i and 2cp-1-i of")
    w.line("    # every sequence; attention sees the whole sequence, global position ids feed "
           "the rotary tables")
    call = "ap.context_parallel_stage(stage, original, mesh, plan.cp_mode" if stage else \
        "ap.context_parallel(model, mesh, plan.cp_mode"
    if stage:
        w.line("    # (the stage's attention nodes run it; the first stage takes the positions)")
    if plan.cp_mode == "hybrid":
        a2a = hybrid_split(plan)
        w.line(f"    # hybrid: all-to-all inside groups of {a2a} cp ranks (one node's), a ring "
               f"across the groups")
        w.line(f"    {call}, all_to_all_ranks={a2a!r})")
    else:
        w.line(f"    {call})")
