"""Small helpers the generated training program (``train.py``) calls, by name, for the steps
that are more than one PyTorch statement."""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from autopar.parallel.context_parallel import apply_context_parallel
from autopar.parallel.expert_parallel import (
    ExpertParallelExperts,
    apply_expert_parallel,
    replicate_expert_data_parallel,
    shard_expert_data_parallel,
)
from autopar.parallel.expert_zero import expert_zero_optimizer as _optimizer
from autopar.parallel.mesh import single_process_mesh as _mesh
from autopar.parallel.policies import recompute_block, use_host_cores
from autopar.parallel.stage_experts import stage_expert_parallel as _stage
from autopar.parallel.tp_styles import localize_heads as _localize_one
from autopar.parallel.traced_stage import prepare_stage as _prepare
from autopar.plan import Plan

__all__ = ["context_parallel", "expert_parallel", "expert_zero_optimizer", "localize_heads", "present", "recompute",
           "replicate_experts", "use_host_cores",
           "prepare_stage", "shard_experts", "single_process_mesh", "stage_expert_parallel"]


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


def prepare_stage(stage: nn.Module, original: nn.Module, leaves: list[str],
                  fused: dict[str, list[int]]) -> None:
    """Ready a traced pipeline stage for tensor parallelism: its split leaves back as the
    original modules (PyTorch's styles take only real nn.Linear / nn.Embedding), its fused
    projections' outputs cut per part on the local shards, and DTensor taught the CPU
    attention kernel's head-parallel sharding."""
    _prepare(stage, original, leaves, fused)


def recompute(model: nn.Module, layer: str, mode: str, seq: int) -> None:
    """Wrap ``layer`` for ``mode`` ("full", "selective" or "op") recompute."""
    recompute_block(model, layer, mode, seq)


def expert_parallel(model: nn.Module, mesh: DeviceMesh) -> list[nn.Module]:
    """Swap each expert module for its expert-parallel version over ``mesh["ep"]``."""
    return apply_expert_parallel(model, None, mesh["ep"])


def stage_expert_parallel(stage: nn.Module, original: nn.Module, mesh: DeviceMesh
                          ) -> list[nn.Module]:
    """In a traced pipeline stage, put the original experts modules back in place of their
    traced copies and swap each for its expert-parallel version over ``mesh["ep"]``."""
    return _stage(stage, original, mesh["ep"])


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


def context_parallel(model: nn.Module, mesh: DeviceMesh, mode: str) -> None:
    """Give ``model`` its context-parallel attention (``mode``: ring | alltoall) over
    ``mesh["cp"]``, and global position ids for its share of each sequence."""
    apply_context_parallel(model, mesh["cp"].get_group(), mode, mesh["tp"].size())


def single_process_mesh(device: str) -> DeviceMesh:
    """An all-ones mesh for a one-device plan that offloads (fully_shard needs a mesh)."""
    return _mesh({"pp": 1, "dp": 1, "ep": 1, "tp": 1}, device)
