"""Apply a Plan to a module with PyTorch's own pieces: DTensor tensor and sequence parallelism
(in tensor_parallel.py), checkpoint wrappers for recompute, DDP / ZeroRedundancyOptimizer /
fully_shard for data parallelism."""

from __future__ import annotations

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh

from autopar.plan import Plan
from autopar.runtime.tensor_parallel import apply_tensor_parallel, layer_names, tied_modules

__all__ = ["apply_data_parallel", "apply_recompute", "apply_tensor_parallel",
           "replicate_data_parallel", "shard_data_parallel"]


# older private names, still imported by sibling modules
_layer_names = layer_names
_tied_modules = tied_modules


def apply_recompute(model: nn.Module, plan: Plan, skip_missing: bool = False) -> None:
    """Wrap each block's module as the plan says: full = the whole layer, selective = its
    attention submodule. ``skip_missing`` for a pipeline stage that holds some layers."""
    for block, mode in zip(plan.model["blocks"], plan.recompute, strict=True):
        name = block["name"]
        if mode == "none" or name in ("head", "tail", "root"):
            continue
        if skip_missing:
            try:
                model.get_submodule(name)
            except AttributeError:
                continue
        target = name
        if mode == "selective":
            layer = model.get_submodule(name)
            attn = next((n for n, _ in layer.named_children() if "attn" in n.lower()), None)
            if attn is None:
                continue
            target = f"{name}.{attn}"
        parent_name, _, child = target.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, checkpoint_wrapper(getattr(parent, child)))


def _data_parallel_kind(plan: Plan, dp_mesh: DeviceMesh | None) -> str:
    """"fully_shard", "ddp" or "none": which wrapper the plan's data parallelism uses."""
    offload = {"optimizer", "params"} & set(plan.offload)
    if (dp_mesh is None or plan.mesh["dp"] == 1) and not offload:
        return "none"
    if plan.mesh["tp"] == 1 and plan.zero_stage <= 1 and not offload:
        return "ddp"
    return "fully_shard"


def shard_data_parallel(model: nn.Module, plan: Plan, dp_mesh: DeviceMesh | None) -> bool:
    """The fully_shard half of :func:`apply_data_parallel` (ZeRO 2/3, or offload), in place;
    returns whether it applied. Works on a meta model, before ``materialize``."""
    if _data_parallel_kind(plan, dp_mesh) != "fully_shard":
        return False
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    reshard = plan.zero_stage == 3
    # FSDP2 offloads parameters, gradients and the optimizer step together; pinned memory
    # needs an accelerator, so it is pinned only where one exists
    offload = {"optimizer", "params"} & set(plan.offload)
    policy = CPUOffloadPolicy(pin_memory=_has_accelerator()) if offload else OffloadPolicy()
    for name in _layer_names(plan):
        fully_shard(model.get_submodule(name), mesh=dp_mesh, reshard_after_forward=reshard,
                    offload_policy=policy)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard, offload_policy=policy)
    return True


def replicate_data_parallel(model: nn.Module, plan: Plan, dp_mesh: DeviceMesh | None
                            ) -> tuple[nn.Module, bool]:
    """The DDP half of :func:`apply_data_parallel` (ZeRO 0/1). DDP broadcasts and buckets
    real tensors, so it runs after ``materialize``. Returns (model,
    use_zero_redundancy_optimizer); the model unchanged when the plan needs no DDP."""
    if _data_parallel_kind(plan, dp_mesh) != "ddp":
        return model, False
    ddp = nn.parallel.DistributedDataParallel(model, process_group=dp_mesh.get_group())
    return ddp, plan.zero_stage == 1


def apply_data_parallel(model: nn.Module, plan: Plan, dp_mesh: DeviceMesh | None
                        ) -> tuple[nn.Module, bool]:
    """DDP for ZeRO 0/1 (with a sharded optimizer for 1) without tensor parallelism, else
    fully_shard: ZeRO-2 keeps parameters gathered after the forward, ZeRO-3 reshards them.
    Optimizer or parameter offload uses fully_shard's CPU offload policy (also with dp = 1).
    The Trainer calls the two halves separately, around ``materialize``.

    Returns (model, use_zero_redundancy_optimizer).
    """
    if shard_data_parallel(model, plan, dp_mesh):
        return model, False
    return replicate_data_parallel(model, plan, dp_mesh)


def _has_accelerator() -> bool:
    import torch

    return torch.cuda.is_available()
