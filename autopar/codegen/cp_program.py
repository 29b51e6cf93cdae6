"""The training program's context-parallel statements (autopar.codegen.program): its mesh with
the cp axis, the dp x cp mesh the replicated parameters' gradients are reduced over, and the
call that gives the model its cp attention."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from autopar.plan import Plan

# the mesh axes with context parallelism, outermost first (tp innermost, as the cost model)
CP_AXES = ("pp", "dp", "cp", "ep", "tp")
# the flattened dp x cp axis: the ranks holding the same parameters (torchtitan's dp_shard_cp)
DP_CP = "dp_cp"


def dp_axis(plan: Plan) -> str:
    """The mesh axis the data-parallel wrapper reduces gradients over: dp, or dp x cp."""
    return DP_CP if plan.mesh.get("cp", 1) > 1 else "dp"


def context_parallel_table(w, plan: Plan) -> None:
    """``MESH`` and ``CP_MODE`` of a program with cp > 1 (``w``: its writer)."""
    m = plan.mesh
    w.line("MESH = {" + ", ".join(f'"{a}": {m[a]}' for a in CP_AXES) + "}")
    w.line(f"CP_MODE = \"{plan.cp_mode}\"  # context parallelism: how attention sees the whole "
           f"sequence (ring | alltoall)")


def context_parallel_mesh(w, plan: Plan) -> None:
    """``build_mesh`` of a program with cp > 1 (``w``: its writer)."""
    shape = tuple(plan.mesh[a] for a in CP_AXES)
    w.line("def build_mesh(device):")
    w.line('    """The named device mesh over the launched processes (tp innermost, then ep, cp, '
           'dp, pp);')
    w.line('    the replicated parameters\' gradients are reduced over dp x cp ("dp_cp")."""')
    names = ", ".join(f'"{a}"' for a in CP_AXES)
    w.line(f"    mesh = init_device_mesh(device, {shape}, mesh_dim_names=({names}))")
    w.line(f"    mesh[\"dp\", \"cp\"]._flatten(\"{DP_CP}\")")
    w.line("    return mesh")
    w.blank(2)


def context_parallel_statements(w, plan: Plan) -> None:
    """The ``parallelize`` lines that give the model its context-parallel attention."""
    w.line(f"    # context parallelism over mesh[\"cp\"] ({plan.mesh['cp']} ranks, {plan.cp_mode}): "
           "each rank holds chunks i and 2cp-1-i of")
    w.line("    # every sequence; attention sees the whole sequence, global position ids feed "
           "the rotary tables")
    w.line("    ap.context_parallel(model, mesh, CP_MODE)")
