"""One named DeviceMesh for the plan: ("pp", "dp", "ep", "tp"), tp innermost."""

from __future__ import annotations

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
