"""One named DeviceMesh for the plan: ("pp", "dp", "ep", "tp"), tp innermost; and :func:`axis`,
the one way the runtime reads an axis of a mesh that may leave it out."""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from autopar.plan import Plan

AXES = ("pp", "dp", "ep", "tp")


def build_mesh(plan: Plan | dict, device_type: str) -> DeviceMesh:
    """The plan's mesh (or a {"pp", "dp", "ep", "tp"} degree dict's) over the current process
    group (world size == plan.devices)."""
    degrees = plan.mesh if isinstance(plan, Plan) else plan
    shape = tuple(degrees[a] for a in AXES)
    return init_device_mesh(device_type, shape, mesh_dim_names=AXES)


def single_process_mesh(plan: Plan | dict, device_type: str) -> DeviceMesh:
    """The plan's (all-ones) mesh for a 1-device plan. fully_shard (offload) needs a mesh; in a
    plain process there is no process group yet, so a 1-rank one is made in memory (under
    torchrun the launcher's is used) instead of letting fully_shard start its own."""
    import torch.distributed as dist

    if not dist.is_initialized():
        backend = "cpu:gloo,cuda:nccl" if device_type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return build_mesh(plan, device_type)


@dataclass(frozen=True)
class MeshAxis:
    """One named axis of a device mesh as the runtime reads it. A generated program's mesh
    holds only the axes in use (its size-1 axes left out): an absent axis reads as size 1,
    no process group and local rank 0, so no caller tests for it."""

    size: int
    mesh: DeviceMesh | None  # the axis's 1-D sub-mesh; None: not in the mesh

    @property
    def group(self) -> ProcessGroup | None:
        """The axis's process group, or None when the axis is absent."""
        return self.mesh.get_group() if self.mesh is not None else None

    @property
    def local_rank(self) -> int:
        """This rank's coordinate on the axis (0 when absent)."""
        return self.mesh.get_local_rank() if self.mesh is not None else 0


def axis(mesh: DeviceMesh | None, name: str) -> MeshAxis:
    """The axis ``name`` of ``mesh`` (None: one process, no mesh): its size, sub-mesh, group and
    local rank, or size 1 and no group when the mesh leaves it out."""
    if mesh is None or name not in (mesh.mesh_dim_names or ()):
        return MeshAxis(1, None)
    sub = mesh[name]
    return MeshAxis(sub.size(), sub)


def replica_axis(mesh: DeviceMesh | None, plan: Plan) -> MeshAxis:
    """The ranks holding the same (non-expert) parameters, whose gradients are averaged: dp,
    or dp x cp under context parallelism (the program's flattened ``dp_cp`` axis, or ``cp``
    alone when dp is 1)."""
    if plan.mesh.get("cp", 1) == 1:
        return axis(mesh, "dp")
    if plan.mesh["dp"] == 1:
        return axis(mesh, "cp")
    sub = mesh["dp_cp"]  # flattened by the program's build_mesh
    return MeshAxis(sub.size(), sub)
