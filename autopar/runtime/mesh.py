"""One named DeviceMesh for the plan: ("pp", "dp", "ep", "tp"), tp innermost."""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from autopar.plan import Plan

AXES = ("pp", "dp", "ep", "tp")


def build_mesh(plan: Plan, device_type: str) -> DeviceMesh:
    """The plan's mesh over the current process group (world size == plan.devices)."""
    shape = tuple(plan.mesh[a] for a in AXES)
    return init_device_mesh(device_type, shape, mesh_dim_names=AXES)
