"""Tensor-parallel styles beyond PyTorch's nn.Linear / nn.Embedding ones: GPT-2's Conv1D, and
fused projections split per head group (each rank its own q, k and v heads, its own gate and
up rows), plus the local head counts a split attention's code must read.

A fused projection's weight is kept as a DTensor ``Shard`` of a *row-permuted* weight: the
permutation puts each rank's share of every part next to each other, so that the ordinary
column split hands rank r ``[q_r, k_r, v_r]`` and the model's own slicing (at its local sizes)
finds its heads. The permutation is recorded on the module (``FUSED_ATTR``); weight
initialisation applies it to the whole tensor before slicing, so values match one process.
"""

from __future__ import annotations

import copy
import re
from functools import partial

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from autopar.errors import PlanError
from autopar.models.hf import is_conv1d
from autopar.parallel.comm import copy_to_group, rows_of_shared

FUSED_ATTR = "_autopar_fused_rows"  # module attribute: {param name: (dim, index tensor)}


def output_dim(module: nn.Module) -> int:
    """The weight dimension that indexes output features."""
    return 1 if is_conv1d(module) else 0


def fused_index(parts: list[int], tp: int) -> torch.Tensor:
    """Row order that makes a contiguous split over ``tp`` hand each rank its share of every
    part: ``[p0_r0, p1_r0, ..., p0_r1, p1_r1, ...]``."""
    starts = [sum(parts[:i]) for i in range(len(parts))]
    rows = []
    for r in range(tp):
        for start, size in zip(starts, parts, strict=True):
            share = size // tp
            rows.append(torch.arange(start + r * share, start + (r + 1) * share))
    return torch.cat(rows)


def _distribute(module: nn.Module, name: str, mesh: DeviceMesh, placement, src_data_rank):
    param = getattr(module, name)
    rows = getattr(module, FUSED_ATTR, {}).get(name)
    if rows is not None and not param.is_meta:  # a materialised model (autopar.parallelize)
        param = param.index_select(rows[0], rows[1].to(param.device))
    module.register_parameter(name, nn.Parameter(
        distribute_tensor(param.detach(), mesh, [placement], src_data_rank=src_data_rank),
        requires_grad=param.requires_grad))


class ColumnParallel(ColwiseParallel):
    """Column parallelism for nn.Linear and Conv1D whose output may be fused parts (each split
    over the ranks on its own, see the module docstring)."""

    def __init__(self, parts: list[int] | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.parts = parts if parts and len(parts) > 1 else None

    def _partition(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        if name:  # a child of the linear (LoRA's dropout): nothing of its own to split
            return
        _distribute(module, "weight", mesh, Shard(output_dim(module)), self.src_data_rank)
        if getattr(module, "bias", None) is not None:
            _distribute(module, "bias", mesh, Shard(0), self.src_data_rank)
        if getattr(module, "lora_B", None) is not None:  # LoRA: B split with the outputs
            _distribute(module, "lora_A", mesh, Replicate(), self.src_data_rank)
            _distribute(module, "lora_B", mesh, Shard(0), self.src_data_rank)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not (isinstance(module, nn.Linear) or is_conv1d(module)):
            raise PlanError(f"column parallelism of {type(module).__name__} is not supported "
                            f"(nn.Linear and Conv1D are); re-plan with tp=1")
        if self.parts:
            index = fused_index(self.parts, device_mesh.size())
            # LoRA's B rows are the fused output rows too
            setattr(module, FUSED_ATTR, {"weight": (output_dim(module), index),
                                         "bias": (0, index), "lora_B": (0, index)})
        return distribute_module(
            module, device_mesh, self._partition,
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))


class RowParallel(RowwiseParallel):
    """Row parallelism for nn.Linear and GPT-2's Conv1D (weight split on its input rows)."""

    def _partition_linear_fn(self, name, module, device_mesh):
        if name:  # a child of the linear (LoRA's dropout): nothing of its own to split
            return
        super()._partition_linear_fn(name, module, device_mesh)
        if getattr(module, "lora_A", None) is not None:  # LoRA: A split with the inputs
            _distribute(module, "lora_A", device_mesh, Shard(1), self.src_data_rank)
            _distribute(module, "lora_B", device_mesh, Replicate(), self.src_data_rank)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not is_conv1d(module):
            return super()._apply(module, device_mesh)

        def partition(name, mod, mesh):
            if name:  # a child of the linear (LoRA's dropout): nothing of its own to split
                return
            _distribute(mod, "weight", mesh, Shard(0), self.src_data_rank)
            if getattr(mod, "bias", None) is not None:
                _distribute(mod, "bias", mesh, Replicate(), self.src_data_rank)
            if getattr(mod, "lora_A", None) is not None:  # LoRA: A split with the inputs
                _distribute(mod, "lora_A", mesh, Shard(1), self.src_data_rank)
                _distribute(mod, "lora_B", mesh, Replicate(), self.src_data_rank)

        self.desired_input_layouts = (Shard(-1),)
        return distribute_module(
            module, device_mesh, partition,
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))


class KvHeadReplicated(ParallelStyle):
    """A key or value projection of an attention with fewer kv heads than tp: its weight stays
    whole (a plain tensor) on every rank, and rank r computes only kv head ``r * kv // tp``,
    the one its query heads read. The input's gradient and the weight's are summed over the
    tensor-parallel ranks (each computed a part). A LoRA-adapted projection keeps its update:
    the rank's rows of ``lora_B`` after the whole ``lora_A``."""

    def __init__(self, kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.kv_heads, self.head_dim = kv_heads, head_dim

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        from torch.distributed.tensor import DTensor, Partial

        if not isinstance(module, nn.Linear):
            raise PlanError(f"kv-head replication of {type(module).__name__} is not supported "
                            f"(nn.Linear is); re-plan with a tp that divides the kv heads")
        tp, group = device_mesh.size(), device_mesh.get_group()
        start = device_mesh.get_local_rank() * self.kv_heads // tp * self.head_dim
        count = self.head_dim

        def forward(x: torch.Tensor) -> torch.Tensor:
            if isinstance(x, DTensor):  # a gathered sequence-parallel input
                x = x.redistribute(device_mesh, (Replicate(),)).to_local(
                    grad_placements=(Partial(),))
            else:
                x = copy_to_group(x, group)
            weight = rows_of_shared(module.weight, start, count, group)
            bias = rows_of_shared(module.bias, start, count, group) \
                if module.bias is not None else None
            out = torch.nn.functional.linear(x, weight, bias)
            if getattr(module, "lora_A", None) is not None:  # LoRA: B's rows of this head,
                # A whole (its gradient, like the weight's, summed over the ranks)
                a = rows_of_shared(module.lora_A, 0, module.lora_A.shape[0], group)
                b = rows_of_shared(module.lora_B, start, count, group)
                update = torch.nn.functional.linear(
                    torch.nn.functional.linear(module.lora_dropout(x), a), b)
                out = out + update * module.scaling
            return out

        module.forward = forward
        return module


class WholeKvProjection(ParallelStyle):
    """A key or value projection of an attention with fewer kv heads than tp, inside a traced
    pipeline stage: its weight stays whole (a plain tensor) on every rank, which computes every
    kv head and returns them as a replicated DTensor.

    :class:`KvHeadReplicated`'s one head per rank needs the attention's code to run at local
    head counts; a traced stage's views keep the whole model's shapes, so the output must be
    the whole projection. The attention's query heads are split: DTensor then hands each rank
    the kv heads its query heads read (replicated -> head shards, no communication), and in the
    backward gathers the key/value gradient whole, so every rank's weight gradient is already
    the whole one (nothing to sum over tp)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        from torch.distributed.tensor import DTensor

        if not isinstance(module, nn.Linear):
            raise PlanError(f"kv-head replication of {type(module).__name__} is not supported "
                            f"(nn.Linear is); re-plan with a tp that divides the kv heads")
        whole = (Replicate(),)

        # hooks, not a new forward: the module's own forward (a LoRA update included) runs on
        # plain tensors
        def local_input(_module, args):
            x = args[0]
            if isinstance(x, DTensor):  # the region's inputs are replicated DTensors
                x = x.redistribute(device_mesh, whole).to_local()
            return (x, *args[1:])

        def replicated_output(_module, _args, out):
            return DTensor.from_local(out, device_mesh, whole, run_check=False)

        module.register_forward_pre_hook(local_input)
        module.register_forward_hook(replicated_output)
        return module


class SharedRotaryKey(ParallelStyle):
    """Latent attention (DeepSeek-V2's MLA, :mod:`autopar.ir.latent`) split by heads: its
    down-projection ``kv_a_proj_with_mqa`` stays whole, and the one rotary key it makes (the
    last ``qk_rope_head_dim`` features) is expanded to each rank's own heads. Each rank's
    gradient for that key covers only its heads, so the key passes through an identity whose
    backward sums it over the tensor-parallel ranks; the latent's gradient is already whole
    (``kv_b_proj``'s column-parallel input is all-reduced by its own style)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        down = getattr(module, "kv_a_proj_with_mqa", None)
        rank = getattr(module, "kv_lora_rank", None)
        if not isinstance(down, nn.Linear) or not isinstance(rank, int):
            raise PlanError(f"{type(module).__name__} has no kv_a_proj_with_mqa / kv_lora_rank "
                            f"to split as latent attention; pin tp=1")
        group = device_mesh.get_group()

        def summed_rotary_key(_module, _args, out):
            latent, key = out[..., :rank], out[..., rank:]
            return torch.cat([latent, copy_to_group(key, group)], dim=-1)

        down.register_forward_hook(summed_rotary_key)
        return module


class HeadSplit(ParallelStyle):
    """Every parameter of a module split by heads along its first dimension (a Prefix Tuning
    prefix [kv_heads, tokens, head_dim], with the attention that reads it)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name, _ in list(module.named_parameters(recurse=False)):
            _distribute(module, name, device_mesh, Shard(0), None)
        return module


# attribute names that hold a head count or a per-module width (not a head's own size)
_COUNT_NAME = re.compile(r"head|split_size|embed_dim|hidden_size|groups")
_NOT_COUNT = re.compile(r"head_dim|head_size|layer_idx|max_position")


def localize_heads(module: nn.Module, heads: list[int], tp: int) -> None:
    """Give a split attention module the head counts of its local heads, for code that reads
    them (Phi-3 slices ``qkv`` at ``num_attention_heads * head_dim``, GPT-2 splits ``c_attn``
    at ``split_size``, Falcon views by ``num_heads``). An integer attribute of the module, or
    of a private copy of its ``config``, whose name says it counts heads or widths and whose
    value is a whole-model head quantity, becomes the per-rank one. With fewer kv heads than
    tp each rank holds one kv head, and its query heads form one group."""
    q, kv, d = heads
    if q % tp or (kv % tp and tp % kv):
        raise PlanError(f"the plan splits an attention of {q} query and {kv} key/value heads "
                        f"over tp={tp}; re-plan (the planner splits only whole heads)")
    local_kv = kv // tp if kv % tp == 0 else 1
    local = {q * d: q * d // tp, kv * d: local_kv * d, kv: local_kv, q: q // tp}
    groups = {q // kv: q // tp // local_kv}  # query heads per kv head
    _localize(module, local, groups)
    config = getattr(module, "config", None)
    if config is not None and not isinstance(config, nn.Module):
        module.config = copy.copy(config)
        _localize(module.config, local, groups)


def _localize(obj: object, local: dict[int, int], groups: dict[int, int]) -> None:
    for name, value in list(vars(obj).items()):
        if type(value) is not int or _NOT_COUNT.search(name):
            continue
        if "groups" in name:
            if value in groups:
                setattr(obj, name, groups[value])
        elif value in local and _COUNT_NAME.search(name):
            setattr(obj, name, local[value])
