"""Small helpers the generated training program (``train.py``) calls, by name, for the steps
that are more than one PyTorch statement, and for what the program reads from the plan
instead of listing it (the layers, the pipeline chunks' boundary relayouts, a traced stage's
split leaves, the recompute rule's layers, the mesh's axes)."""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle

from autopar.errors import PlanError
from autopar.parallel.context_parallel import apply_context_parallel
from autopar.parallel.cp_stage import apply_stage_context_parallel
from autopar.parallel.expert_parallel import (
    ExpertParallelExperts,
    apply_expert_parallel,
    replicate_expert_data_parallel,
    shard_expert_data_parallel,
)
from autopar.parallel.expert_zero import expert_zero_optimizer as _optimizer
from autopar.parallel.mesh import MeshAxis
from autopar.parallel.mesh import axis as _axis
from autopar.parallel.mesh import single_process_mesh as _mesh
from autopar.parallel.pipeline import TIES_ATTR
from autopar.parallel.policies import recompute_block, use_host_cores
from autopar.parallel.stage_experts import stage_expert_parallel as _stage
from autopar.parallel.tensor_parallel import build_styles, chunk_boundary_styles, layer_names
from autopar.parallel.tensor_parallel import tensor_parallel_layout as _layout
from autopar.parallel.tp_styles import localize_heads as _localize_one
from autopar.parallel.traced_stage import prepare_stage as _prepare
from autopar.plan import Plan

__all__ = ["axis", "chunk_boundaries", "context_parallel", "context_parallel_stage", "expert_parallel",
           "expert_zero_optimizer", "layers", "localize_heads", "prepare_stage", "present",
           "recompute", "recompute_modes", "replicate_experts", "shard_experts",
           "single_process_mesh", "split_heads", "stage_expert_parallel", "use_host_cores"]


def present(model: nn.Module, items: Iterable[str] | dict) -> list[str] | dict:
    """The module paths (or the entries of a path-keyed dict) that ``model`` holds: a pipeline
    stage holds some layers only."""
    names = {n for n, _ in model.named_modules()}
    if isinstance(items, dict):
        return {k: v for k, v in items.items() if k in names}
    return [k for k in items if k in names]


def localize_heads(model: nn.Module, heads: dict[str, tuple[int, int, int]], tp: int) -> None:
    """Each split attention module of ``model`` reads the head counts of its local heads."""
    for path, (q, kv, d) in present(model, heads).items():
        _localize_one(model.get_submodule(path), [q, kv, d], tp)


def prepare_stage(stage: nn.Module, original: nn.Module, plan: Plan | list[str],
                  fused: dict[str, list[int]] | None = None) -> None:
    """Ready a traced pipeline stage for tensor parallelism: its split leaves back as the
    original modules (PyTorch's styles take only real nn.Linear / nn.Embedding), its fused
    projections' outputs cut per part on the local shards, and DTensor taught the CPU
    attention kernel's head-parallel sharding. The leaves and fused parts are the plan's
    (``plan``), or, as programs before the plan was their source wrote it, a list of leaves
    and ``fused``."""
    if isinstance(plan, Plan):
        # the layout of the model as planned: with its ties, which the pipeline undid
        tied, aliases = getattr(original, TIES_ATTR, (None, frozenset()))
        layout = _layout(original, plan, traced=True, tied=tied, aliases=aliases)
        _prepare(stage, original, layout.leaves, layout.fused)
    else:
        _prepare(stage, original, plan, fused or {})


def layers(model: nn.Module, plan: Plan) -> list[str]:
    """The paths of the plan's repeated layers that ``model`` holds (a pipeline stage holds
    some only), in model order: each one tensor-parallel, recompute and fully_shard unit."""
    return present(model, layer_names(plan))


def chunk_boundaries(plan: Plan) -> dict[str, ParallelStyle]:
    """The relayouts at the pipeline chunks' boundaries under sequence parallelism (a chunk's
    first layer takes its sequence shard of the whole activation it receives, its last
    gathers its output whole for the next stage), by layer path."""
    return build_styles(chunk_boundary_styles(plan))


def split_heads(model: nn.Module, plan: Plan, mesh: DeviceMesh) -> None:
    """Each attention module the plan splits over ``mesh``'s tp axis reads the head counts of
    its local heads (before ``parallelize_module``)."""
    localize_heads(model, _layout(model, plan).heads, _axis(mesh, "tp").size)


def recompute_modes(model: nn.Module, plan: Plan, rule: dict[str, str]) -> dict[str, str]:
    """The recompute mode of each of the plan's layers that ``model`` holds, by ``rule``: a
    block type's mode for every layer of that type ({"transformer": "op"}), then the layers
    named as exceptions, one path or a range of layer indices ("model.layers.8-15": both
    ends included). Layers left at "none" are not listed."""
    kinds = {b.kind for b in plan.model.blocks if b.is_layer}
    names = set(layer_names(plan))
    for key in rule:
        if key not in kinds and not _range_of(key) and key not in names:
            raise PlanError(f"RECOMPUTE names {key!r}, neither a block type ({', '.join(sorted(kinds))}) "
                            f"nor a layer of the plan; fix the program's RECOMPUTE, or delete "
                            f"train.py to regenerate it")
    held = set(layers(model, plan))
    modes: dict[str, str] = {}
    for block in plan.model.blocks:
        if not block.is_layer or block.name not in held:
            continue
        mode = rule.get(block.kind, "none")
        for key, value in rule.items():
            if key == block.name or block.name in _range_of(key):
                mode = value
        if mode != "none":
            modes[block.name] = mode
    return modes


def _range_of(key: str) -> set[str]:
    """The layer paths a "prefix.A-B" key names (A to B, both included); empty for any
    other key."""
    prefix, _, span = key.rpartition(".")
    first, dash, last = span.partition("-")
    if not (prefix and dash and first.isdigit() and last.isdigit()):
        return set()
    return {f"{prefix}.{i}" for i in range(int(first), int(last) + 1)}


def axis(mesh: DeviceMesh | None, name: str) -> MeshAxis:
    """The axis ``name`` of ``mesh``: its size, sub-mesh and group, or size 1 and no group
    when the program's mesh leaves it out (an axis of size 1)."""
    return _axis(mesh, name)


def recompute(model: nn.Module, layer: str, mode: str, seq: int) -> None:
    """Wrap ``layer`` for ``mode`` ("full", "selective" or "op") recompute."""
    recompute_block(model, layer, mode, seq)


def expert_parallel(model: nn.Module, mesh: DeviceMesh) -> list[nn.Module]:
    """Swap each expert module for its expert-parallel version over ``mesh["ep"]``."""
    return apply_expert_parallel(model, None, _axis(mesh, "ep").mesh)


def stage_expert_parallel(stage: nn.Module, original: nn.Module, mesh: DeviceMesh
                          ) -> list[nn.Module]:
    """In a traced pipeline stage, put the original experts modules back in place of their
    traced copies and swap each for its expert-parallel version over ``mesh["ep"]``."""
    return _stage(stage, original, _axis(mesh, "ep").mesh)


def shard_experts(model: nn.Module, mesh: DeviceMesh, plan: Plan, experts: list) -> None:
    """fully_shard for an expert-parallel model: dense modules over dp x ep, experts over dp
    (nothing under ZeRO-0, which replicates after the weights exist)."""
    shard_expert_data_parallel(model, plan, mesh, experts)


def replicate_experts(model: nn.Module, mesh: DeviceMesh, plan: Plan) -> nn.Module:
    """DDP over dp x ep for an expert-parallel model's dense parameters under ZeRO-0."""
    experts = [m for m in model.modules() if isinstance(m, ExpertParallelExperts)]
    return replicate_expert_data_parallel(model, plan, mesh, experts)


def expert_zero_optimizer(param_groups: list[dict], mesh: DeviceMesh, optimizer_class: type,
                          **defaults):
    """ZeRO-1 under expert parallelism: ``optimizer_class`` with the dense parameters' states
    sharded over dp x ep and the experts' over dp (after the ZeRO-0 gradient sync)."""
    return _optimizer(param_groups, mesh, optimizer_class, **defaults)


def context_parallel(model: nn.Module, mesh: DeviceMesh, mode: str,
                     all_to_all_ranks: int = 0) -> None:
    """Give ``model`` its context-parallel attention (``mode``: ring | alltoall | hybrid, the
    last with all-to-all inside groups of ``all_to_all_ranks`` cp ranks) over ``mesh["cp"]``,
    and global position ids for its share of each sequence."""
    apply_context_parallel(model, _axis(mesh, "cp").group, mode, _axis(mesh, "tp").size,
                           all_to_all_ranks)


def context_parallel_stage(stage: nn.Module, original: nn.Module, mesh: DeviceMesh, mode: str,
                           all_to_all_ranks: int = 0) -> None:
    """:func:`context_parallel` for a pipeline stage traced from ``original``: its attention
    nodes run the cp attention, the first stage's position input gets global positions."""
    apply_stage_context_parallel(stage, original, _axis(mesh, "cp").group, mode,
                                 _axis(mesh, "tp").size, all_to_all_ranks)


def single_process_mesh(device: str) -> DeviceMesh:
    """An all-ones mesh for a one-device plan that offloads (fully_shard needs a mesh)."""
    return _mesh({"pp": 1, "dp": 1, "ep": 1, "tp": 1}, device)
