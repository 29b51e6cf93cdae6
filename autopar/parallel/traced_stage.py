"""Traced pipeline stages under tensor parallelism: what a stage traced from the whole model
needs before PyTorch's styles apply (the original leaf modules back, fused outputs cut per
part on the local shards) and DTensor's head-parallel rule for the CPU attention kernel."""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard

from autopar.errors import PlanError
from autopar.parallel.tp_styles import is_conv1d


def prepare_stage(stage: nn.Module, original: nn.Module, leaves: list[str],
                  fused: dict[str, list[int]]) -> None:
    """Ready a traced stage of ``original`` for tensor parallelism: its split leaves back as
    the original modules, its fused projections' outputs cut per part on the local shards,
    and DTensor taught the CPU attention kernel's head-parallel sharding."""
    present = {n for n, _ in stage.named_modules()}
    register_cpu_attention_sharding()
    drop_metadata_asserts(stage)
    link_originals(stage, original)
    restore_leaves(stage, original, [p for p in leaves if p in present])
    split_fused_outputs(stage, {p: v for p, v in fused.items() if p in present})


ORIGINAL_ATTR = "_autopar_original"


def stream_position(module: nn.Module) -> int | None:
    """Which positional input of a traced layer (or region) is the residual stream, or None
    for a module that is not traced. The trace orders a module's inputs its own way (a
    Hugging Face decoder layer gets the mask and rotary tables first, the hidden states
    last): the stream is the one input shaped like the module's output."""
    graph = getattr(module, "graph", None)
    if not isinstance(graph, torch.fx.Graph):
        return None
    output = next(n for n in graph.nodes if n.op == "output").args[0]
    first = output[0] if isinstance(output, (tuple, list)) else output
    shape = getattr(getattr(first, "meta", {}).get("val"), "shape", None)
    inputs = [n for n in graph.nodes if n.op == "placeholder"]
    matches = [i for i, n in enumerate(inputs)
               if shape is not None and getattr(n.meta.get("val"), "shape", None) == shape]
    if len(matches) != 1:
        raise PlanError(f"cannot tell which input of a traced {type(module).__name__} is the "
                        f"residual stream ({len(matches)} inputs shaped like its output); "
                        f"re-plan with constraints sequence_parallel=false")
    return matches[0]


def drop_metadata_asserts(stage: nn.Module) -> None:
    """Remove the dtype/device assertions torch.export records for each ``Tensor.to`` (as
    ``aten._assert_tensor_metadata``) from every graph a traced stage holds. They assert the
    dtypes of the fp32 trace, which bf16/fp16 autocast changes at run time (a MoE router's
    ``logits.float()`` reads bf16 logits: "Tensor dtype mismatch"); DTensor has no sharding
    rule for them, and under sequence parallelism a norm's ``to(float32)`` reads a DTensor.
    The ``to`` itself stays in the graph: they compute nothing."""
    target = torch.ops.aten._assert_tensor_metadata.default
    for module in stage.modules():
        graph = getattr(module, "graph", None)
        if not isinstance(graph, torch.fx.Graph):
            continue
        asserts = [n for n in graph.nodes if n.op == "call_function" and n.target is target
                   and not n.users]
        for node in asserts:
            graph.erase_node(node)
        # an unflattened InterpreterModule keeps its generated code outside _modules
        code = module if isinstance(module, torch.fx.GraphModule) else \
            module.__dict__.get("graph_module")
        if asserts and code is not None:
            code.recompile()


def link_originals(stage: nn.Module, original: nn.Module) -> None:
    """Point each traced submodule of a stage at the module of ``original`` it was traced
    from: a layer run from its graph (graph_tp) is exported from the model's own code, which
    the trace may have simplified in ways only its first shapes allowed (a ``contiguous``
    dropped where the traced kernel's strides made it a no-op). Kept out of the module tree."""
    have = dict(original.named_modules())
    for path, module in stage.named_modules():
        if path and path in have and hasattr(module, "graph"):
            object.__setattr__(module, ORIGINAL_ATTR, have[path])


def restore_leaves(stage: nn.Module, original: nn.Module, split: list[str]) -> None:
    """Put the original nn.Linear / nn.Embedding back where a traced stage holds a graph
    module for a split leaf: PyTorch's TP styles accept only the real module types. The
    stage calls the leaf with its one input and shares the original's parameters."""
    for path in split:
        leaf = stage.get_submodule(path)
        if isinstance(leaf, (nn.Linear, nn.Embedding)) or is_conv1d(leaf):
            continue
        module = original.get_submodule(path)
        graph = getattr(leaf, "graph", None)
        inputs = [n for n in graph.nodes if n.op == "placeholder"] if graph is not None else []
        if len(inputs) != 1 or any(p is not getattr(module, n, None)
                                   for n, p in leaf.named_parameters()):
            raise PlanError(f"the traced pipeline stage calls {path} in a form tensor "
                            f"parallelism cannot wrap; re-plan with tp=1 or pp=1")
        parent, _, child = path.rpartition(".")
        setattr(stage.get_submodule(parent) if parent else stage, child, module)


def split_fused_outputs(stage: nn.Module, fused: dict[str, list[int]]) -> None:
    """In a traced pipeline stage, cut each fused projection's output into its parts on the
    local shards: the trace cuts it at global offsets, which on the per-part split weight
    (see tp_styles) would gather it whole. Each part becomes a DTensor sharded like the
    projection's output, holding this rank's heads of that part."""
    for path, parts in fused.items():
        parent_name, _, child = path.rpartition(".")
        parent = stage.get_submodule(parent_name) if parent_name else stage
        graph = getattr(parent, "graph", None)
        call = next((n for n in graph.nodes if n.op == "call_module" and n.target == child),
                    None) if graph is not None else None
        users = list(call.users) if call is not None else []
        names = {str(getattr(u.target, "__name__", u.target)).split(".")[0] for u in users}
        slices = names <= {"slice"}
        if not users or not (slices or (len(users) == 1 and
                                        names <= {"split", "split_with_sizes", "chunk"})):
            raise PlanError(f"the traced pipeline stage uses {path}'s fused output in a form "
                            f"it cannot cut per part; re-plan with tp=1 or pp=1")
        for user in users:
            user.target = _cut_part if slices else _cut_parts
            user.kwargs = {**user.kwargs, "parts": tuple(parts)}
        if hasattr(parent, "recompile"):
            parent.recompile()


def _local_parts(x, parts: tuple[int, ...], dim: int):
    from torch.distributed.tensor import DTensor

    tp = x.device_mesh.size()
    dim = dim % x.ndim
    pieces = x.to_local().split([p // tp for p in parts], dim)
    return tuple(DTensor.from_local(piece, x.device_mesh, x.placements, run_check=False)
                 for piece in pieces)


def _cut_parts(x, _size, dim: int = 0, *, parts: tuple[int, ...] = ()):
    """aten.split or aten.chunk of a fused output, on the local shards (see
    :func:`split_fused_outputs`)."""
    return _local_parts(x, parts, dim)


def _cut_part(x, dim: int = 0, start: int | None = None, end: int | None = None,
              step: int = 1, *, parts: tuple[int, ...] = ()):
    """aten.slice of a fused output at a part's global offsets, on the local shards."""
    offsets = [sum(parts[:i]) for i in range(len(parts))]
    start = 0 if start is None else start
    if start not in offsets:
        raise PlanError(f"a fused projection's output is cut at {start}, not at a part boundary "
                        f"{offsets}; re-plan with tp=1 or pp=1")
    return _local_parts(x, parts, dim)[offsets.index(start)]


@functools.cache
def register_cpu_attention_sharding() -> None:
    """DTensor has head-parallel rules for the CUDA attention kernels but not for the CPU one
    that a traced stage's scaled_dot_product_attention lowers to; register the same rule:
    query/key/value/output/logsumexp split on heads (dim 1), a one-head mask replicated."""
    from torch.distributed.tensor.experimental import register_sharding

    aten = torch.ops.aten

    def mask_layout(mask):
        if mask is None:
            return None
        return Replicate() if mask.shape[1] == 1 else Shard(1)

    @register_sharding(aten._scaled_dot_product_flash_attention_for_cpu.default)
    def _forward(query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None,
                 scale=None):
        heads = ([Shard(1), Shard(1)],
                 [Shard(1), Shard(1), Shard(1), None, None, mask_layout(attn_mask), None])
        whole = ([Replicate(), Replicate()],
                 [Replicate(), Replicate(), Replicate(), None, None,
                  None if attn_mask is None else Replicate(), None])
        return [heads, whole]

    @register_sharding(aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
    def _backward(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *,
                  attn_mask=None, scale=None):
        heads = ([Shard(1)] * 3, [Shard(1)] * 6 + [None, None, mask_layout(attn_mask), None])
        whole = ([Replicate()] * 3, [Replicate()] * 6 +
                 [None, None, None if attn_mask is None else Replicate(), None])
        return [heads, whole]
