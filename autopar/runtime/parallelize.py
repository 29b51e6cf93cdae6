"""Apply a Plan to a module with PyTorch's own pieces: DTensor tensor parallelism, checkpoint
wrappers for recompute, DDP / ZeroRedundancyOptimizer / fully_shard for data parallelism."""

from __future__ import annotations

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh

from autopar.errors import PlanError
from autopar.plan import Plan


def _layer_names(plan: Plan) -> list[str]:
    return [b["name"] for b in plan.model["blocks"] if b["name"] not in ("head", "tail", "root")]


def _tied_modules(model: nn.Module) -> set[str]:
    """Modules whose weight is shared with another module (tied embedding and head)."""
    owners: dict[int, list[str]] = {}
    for name, module in model.named_modules():
        w = getattr(module, "weight", None)
        if isinstance(w, nn.Parameter):
            owners.setdefault(id(w), []).append(name)
    return {n for names in owners.values() if len(names) > 1 for n in names}


def apply_tensor_parallel(model: nn.Module, plan: Plan, tp_mesh: DeviceMesh) -> list[str]:
    """Column/row/vocabulary-parallel modules from the plan's parameter placements.

    Returns the module paths it parallelised. Tied weights stay replicated (one Parameter
    cannot carry two layouts).
    """
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    layers = _layer_names(plan)
    tied = _tied_modules(model)
    styles: dict[str, object] = {}
    for fqn, placement in plan.placements["params"].items():
        if not fqn.endswith(".weight") or "@tp" not in placement:
            continue
        path = fqn[: -len(".weight")]
        if path in tied:
            continue
        module = model.get_submodule(path)
        in_layer = any(path == n or path.startswith(n + ".") for n in layers)
        if isinstance(module, nn.Embedding):
            styles[path] = RowwiseParallel(input_layouts=Replicate())
        elif not isinstance(module, nn.Linear):
            raise PlanError(f"the plan splits {path} ({type(module).__name__}) over tp, but "
                            f"only nn.Linear and nn.Embedding can be split; pin tp=1")
        elif placement.startswith("Shard(0)"):
            # a column-parallel linear outside the layers is the LM head: gather the logits
            styles[path] = ColwiseParallel() if in_layer else \
                ColwiseParallel(output_layouts=Replicate())
        else:
            styles[path] = RowwiseParallel()
    if styles:
        parallelize_module(model, tp_mesh, styles)
    return sorted(styles)


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


def apply_data_parallel(model: nn.Module, plan: Plan, dp_mesh: DeviceMesh | None
                        ) -> tuple[nn.Module, bool]:
    """DDP for ZeRO 0/1 (with a sharded optimizer for 1) without tensor parallelism, else
    fully_shard: ZeRO-2 keeps parameters gathered after the forward, ZeRO-3 reshards them.
    Optimizer or parameter offload uses fully_shard's CPU offload policy (also with dp = 1).

    Returns (model, use_zero_redundancy_optimizer).
    """
    offload = {"optimizer", "params"} & set(plan.offload)
    if dp_mesh is None or plan.mesh["dp"] == 1:
        if not offload:
            return model, False
    if plan.mesh["tp"] == 1 and plan.zero_stage <= 1 and not offload:
        ddp = nn.parallel.DistributedDataParallel(model, process_group=dp_mesh.get_group())
        return ddp, plan.zero_stage == 1
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    reshard = plan.zero_stage == 3
    # FSDP2 offloads parameters, gradients and the optimizer step together; pinned memory
    # needs an accelerator, so it is pinned only where one exists
    policy = CPUOffloadPolicy(pin_memory=_has_accelerator()) if offload else OffloadPolicy()
    for name in _layer_names(plan):
        fully_shard(model.get_submodule(name), mesh=dp_mesh, reshard_after_forward=reshard,
                    offload_policy=policy)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard, offload_policy=policy)
    return model, False


def _has_accelerator() -> bool:
    import torch

    return torch.cuda.is_available()
