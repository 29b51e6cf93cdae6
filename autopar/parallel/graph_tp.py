"""Tensor parallelism for a layer as it is written: :class:`GraphParallel` splits the layer's
parameters as the plan places them and runs the layer from its own exported graph, rewritten
for this rank's shards (:mod:`autopar.capture.layer_split`).

Why a graph here and module styles elsewhere: DTensor's module styles keep the layer's Python
code, and code written for whole tensors reads whole sizes (``B, T, C = x.size()`` then
``split(self.n_embd)``), or uses a weight outside its module (nn.MultiheadAttention multiplies
by ``out_proj.weight`` itself, so a style on ``out_proj`` never runs). Both break on a shard.
The exported graph states every size; the rewrite changes exactly the sizes and collectives
the split implies, and refuses what it cannot follow. Hugging Face decoders and autopar's own
models keep the module styles they are tested with (``tensor_parallel.py``); every other
model's layers run from their graph.

The graph is exported on meta at the shapes the layer is first called with (once per distinct
call, shared by the layers of one class), so the run's micro-batch and sequence length are the
ones it was traced at. Parameters are read at each call (FSDP swaps them), as local shards.
"""

from __future__ import annotations

import copy

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle
from torch.export.graph_signature import InputKind, OutputKind

from autopar.capture.layer_graph import export_layer, split_layer_graph
from autopar.capture.layer_split import Collectives
from autopar.errors import PlanError
from autopar.parallel.comm import copy_to_group, reduce_from_group
from autopar.parallel.tp_styles import FUSED_ATTR, _distribute, fused_index
from autopar.parallel.traced_stage import ORIGINAL_ATTR


class _Copy(nn.Module):
    def __init__(self, group) -> None:
        super().__init__()
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return copy_to_group(x, self.group)


class _Reduce(_Copy):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return reduce_from_group(x, self.group)


class GraphParallel(ParallelStyle):
    """Split a layer's parameters (``params``: relative name -> shard dimension over tp;
    ``fused``: a parameter's fused parts, each split on its own) and run the layer from its
    graph, rewritten for the local shards."""

    def __init__(self, params: dict[str, int], fused: dict[str, list[int]] | None = None
                 ) -> None:
        super().__init__()
        self.params, self.fused = dict(params), dict(fused or {})

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        have = {n for n, _ in module.named_parameters()}
        unknown = sorted(set(self.params) - have)
        if unknown:
            raise PlanError(f"the plan splits {unknown[0]}, which this layer does not have; "
                            f"re-plan this model")
        # whole shapes, to export from (before the split): the model's own layer when this
        # is a traced copy of it
        template = copy.deepcopy(getattr(module, ORIGINAL_ATTR, module)).to("meta")
        tp = device_mesh.size()
        for name, dim in self.params.items():
            owner_path, _, leaf = name.rpartition(".")
            owner = module.get_submodule(owner_path)
            parts = self.fused.get(name)
            if parts:  # a column split (layer_graph.linear_kinds refuses parts on others):
                # along the weight's output dim, 1 for an einsum weight stored (in, out)
                rows = getattr(owner, FUSED_ATTR, {})
                rows[leaf] = (dim, fused_index(parts, tp))
                setattr(owner, FUSED_ATTR, rows)
            _distribute(owner, leaf, device_mesh, Shard(dim), None)
        for name, param in list(module.named_parameters()):
            if name not in self.params and not isinstance(param, DTensor):
                owner_path, _, leaf = name.rpartition(".")
                _distribute(module.get_submodule(owner_path), leaf, device_mesh, Replicate(),
                            None)
        runner = _GraphRunner(module, template, self.params, self.fused, device_mesh)
        module.forward = runner
        return module


class _GraphRunner:
    """The layer's forward: its graph for the call's shapes, rewritten once, then run on the
    layer's local shards."""

    _cache: dict[tuple, tuple] = {}

    def __init__(self, module: nn.Module, template: nn.Module, params: dict[str, int],
                 fused: dict[str, list[int]], mesh: DeviceMesh) -> None:
        self.module, self.template, self.params, self.fused = module, template, params, fused
        self.mesh = mesh
        self.layout = (type(module), tuple((n, tuple(p.shape)) for n, p in
                                           template.named_parameters()),
                       tuple(sorted(params.items())),
                       tuple((k, tuple(v)) for k, v in sorted(fused.items())), id(mesh))

    def __call__(self, *args, **kwargs):
        key = (self.layout, self.module.training, _call_key(args, kwargs))
        entry = self._cache.get(key)
        if entry is None:
            entry = self._cache[key] = self._build(args, kwargs)
        gm, signature, in_spec, out_spec, constants = entry
        flat, spec = pytree.tree_flatten((args, _reorder(kwargs, in_spec)))
        if spec != in_spec:
            raise PlanError("a layer run from its graph was called with arguments of another "
                            "structure than it was traced with; report this model")
        user = iter(flat)
        inputs = []
        for spec_in in signature.input_specs:
            if spec_in.kind == InputKind.PARAMETER:
                inputs.append(_local(self.module.get_parameter(spec_in.target)))
            elif spec_in.kind == InputKind.BUFFER:
                inputs.append(_local(self.module.get_buffer(spec_in.target)))
            elif spec_in.kind == InputKind.CONSTANT_TENSOR:
                inputs.append(constants[spec_in.target])
            else:
                inputs.append(next(user))
        outputs = gm(*inputs)
        results = []
        for spec_out, value in zip(signature.output_specs, outputs, strict=True):
            if spec_out.kind == OutputKind.BUFFER_MUTATION:
                with torch.no_grad():
                    _local(self.module.get_buffer(spec_out.target)).copy_(value)
            elif spec_out.kind == OutputKind.USER_OUTPUT:
                results.append(value)
        return pytree.tree_unflatten(results, out_spec)

    def _build(self, args, kwargs):
        program = export_layer(self.template, args, kwargs, self.module.training)
        group = self.mesh.get_group()
        gm = split_layer_graph(program, self.params, self.fused, self.mesh.size(),
                               Collectives(copy=_Copy(group), reduce=_Reduce(group)),
                               type(self.module).__name__)
        return (gm, program.graph_signature, program.call_spec.in_spec,
                program.call_spec.out_spec, dict(program.constants))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _call_key(args, kwargs) -> tuple:
    flat, spec = pytree.tree_flatten((args, kwargs))
    return (str(spec), tuple((tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else
                             (type(x).__name__, x if isinstance(x, (int, float, bool, str,
                                                                    type(None))) else None)
                             for x in flat))


def _reorder(kwargs: dict, in_spec) -> dict:
    from torch.export._tree_utils import reorder_kwargs

    return reorder_kwargs(kwargs, in_spec) if kwargs else kwargs
