"""Tensor and sequence parallelism from a plan's parameter placements, with PyTorch's DTensor
styles (parallelize_module), on a whole model or on a traced pipeline stage.

Which modules are embeddings, norms and layer sub-blocks is read from the model's structure and
the plan (its blocks and parameter placements), never from a model's name:

* a norm is a leaf module whose parameters are all 1-D (LayerNorm, RMSNorm, HF's LlamaRMSNorm);
* a region is a direct child of a layer that holds parameters and is not a norm (attention,
  MLP, MoE block); its input is gathered over the sequence, its output scattered back;
* the head side is what the model registers before its first layer (embeddings), the tail side
  what it registers after the last one (final norm, LM head).
"""

from __future__ import annotations

import functools
import inspect

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from autopar.errors import PlanError
from autopar.plan import Plan

SEQ = 1  # the sequence dimension of the (batch, sequence, hidden) residual stream


def layer_names(plan: Plan) -> list[str]:
    """Module paths of the plan's repeated layers, in model order."""
    return [b["name"] for b in plan.model["blocks"] if b["name"] not in ("head", "tail", "root")]


def tied_modules(model: nn.Module) -> set[str]:
    """Modules whose weight is shared with another module (tied embedding and head)."""
    owners: dict[int, list[str]] = {}
    for name, module in model.named_modules():
        w = getattr(module, "weight", None)
        if isinstance(w, nn.Parameter):
            owners.setdefault(id(w), []).append(name)
    return {n for names in owners.values() if len(names) > 1 for n in names}


def _relayout(t: object, mesh: DeviceMesh, src: Placement, dst: Placement, local: bool):
    """``t`` as a DTensor laid out ``dst``; a plain tensor is taken to be laid out ``src``."""
    if not isinstance(t, torch.Tensor):
        return t
    dt = t if isinstance(t, DTensor) else DTensor.from_local(t, mesh, (src,), run_check=False)
    if tuple(dt.placements) != (dst,):
        dt = dt.redistribute(mesh, (dst,))
    return dt.to_local() if local else dt


class Relayout(ParallelStyle):
    """Lay out a module's hidden states: its first input (positional, or the keyword named like
    ``forward``'s first parameter, since HF decoder layers call attention with
    ``hidden_states=``) and the first tensor of its output.

    PrepareModuleInput/Output need the call's exact arity and positional/keyword form, which
    differ between models; this touches only the hidden states. ``replicate_rest`` turns every
    other plain tensor input (rotary tables, masks) into a replicated DTensor so that a traced
    stage's DTensor arithmetic does not mix in plain tensors.
    """

    def __init__(self, *, inputs: tuple[Placement, Placement] | None = None,
                 outputs: tuple[Placement, Placement] | None = None,
                 local_input: bool = False, replicate_rest: bool = False) -> None:
        super().__init__()
        self.inputs, self.outputs = inputs, outputs
        self.local_input, self.replicate_rest = local_input, replicate_rest

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        params = list(inspect.signature(module.forward).parameters.values())
        first = params[0].name if params and params[0].kind in (
            inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY) else None
        rep = (Replicate(), Replicate(), False)

        def pre(_mod, args, kwargs):
            args, kwargs = list(args), dict(kwargs)
            key = 0 if args else first if first in kwargs else None
            if self.replicate_rest:
                for i, a in enumerate(args):
                    args[i] = _relayout(a, device_mesh, *rep)
                kwargs = {k: _relayout(v, device_mesh, *rep) for k, v in kwargs.items()}
            if self.inputs is not None and key is not None:
                holder = args if key == 0 else kwargs
                holder[key] = _relayout(holder[key], device_mesh, *self.inputs, self.local_input)
            return tuple(args), kwargs

        def post(_mod, _args, output):
            if isinstance(output, (tuple, list)) and output:
                head = _relayout(output[0], device_mesh, *self.outputs, False)
                return type(output)([head, *output[1:]])
            return _relayout(output, device_mesh, *self.outputs, False)

        module.register_forward_pre_hook(pre, with_kwargs=True)
        if self.outputs is not None:
            module.register_forward_hook(post)
        return module


def _is_norm(module: nn.Module) -> bool:
    params = list(module.parameters())
    return (not list(module.children()) and bool(params)
            and all(p.dim() == 1 for p in params))


def _has_params(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _split(model: nn.Module, plan: Plan, tied: set[str]) -> dict[str, str]:
    """path -> "col" | "row" for the modules of ``model`` whose weight the plan splits over tp
    (tied weights stay replicated: one Parameter cannot carry two layouts)."""
    present = dict(model.named_modules())
    out = {}
    for fqn, placement in plan.placements["params"].items():
        if not fqn.endswith(".weight") or "@tp" not in placement:
            continue
        path = fqn[: -len(".weight")]
        if path in tied or path not in present:
            continue
        out[path] = "col" if placement.startswith("Shard(0)") else "row"
    return out


def _check_kind(path: str, module: nn.Module) -> None:
    if not isinstance(module, (nn.Linear, nn.Embedding)):
        raise PlanError(f"the plan splits {path} ({type(module).__name__}) over tp, but only "
                        f"nn.Linear and nn.Embedding can be split; pin tp=1")


def _under(path: str, prefixes: list[str]) -> str | None:
    return next((p for p in prefixes if path == p or path.startswith(p + ".")), None)


def apply_tensor_parallel(model: nn.Module, plan: Plan, tp_mesh: DeviceMesh, *,
                          tied: set[str] | None = None, original: nn.Module | None = None,
                          whole_logits: bool = False) -> list[str]:
    """Column/row/vocabulary-parallel modules from the plan's parameter placements, and
    Megatron sequence parallelism when ``plan.sequence_parallel``.

    ``model`` is the whole model, or a pipeline stage traced from ``original`` (then the
    layers' column-parallel outputs stay DTensors so that the shapes the trace baked into its
    views stay global). ``tied`` names the tied modules of the original model (a stage holds
    its own copies). ``whole_logits`` makes a column-parallel LM head gather its output (for a
    caller's own loss) instead of leaving it split for a vocabulary-parallel loss. Returns the
    module paths it split.
    """
    tied = tied_modules(model) if tied is None else tied
    split = _split(model, plan, tied)
    for path in split:
        _check_kind(path, (original if original is not None else model).get_submodule(path))
    if original is not None:
        _restore_leaves(model, original, split)
    if plan.sequence_parallel:
        if original is not None:
            raise PlanError("sequence parallelism inside pipeline stages is not supported "
                            "(stages exchange whole activations); re-plan with constraints "
                            "sequence_parallel=false or pp=1")
        styles = _sequence_parallel_styles(model, plan, split, whole_logits)
    else:
        styles = _tensor_parallel_styles(model, plan, split, traced=original is not None,
                                         whole_logits=whole_logits)
    if styles:
        parallelize_module(model, tp_mesh, styles)
    return sorted(split)


def _tensor_parallel_styles(model: nn.Module, plan: Plan, split: dict[str, str],
                            traced: bool, whole_logits: bool = False
                            ) -> dict[str, ParallelStyle]:
    layers = [n for n in layer_names(plan) if n in dict(model.named_modules())]
    styles: dict[str, ParallelStyle] = {}
    for path, kind in split.items():
        module = model.get_submodule(path)
        in_layer = _under(path, layers) is not None
        if isinstance(module, nn.Embedding):
            styles[path] = RowwiseParallel(input_layouts=Replicate())
        elif kind == "col" and in_layer:
            styles[path] = ColwiseParallel(use_local_output=not traced)
        elif kind == "col" and (traced or whole_logits):  # whole logits: a pipeline's last
            # stage, or a caller's own loss
            styles[path] = ColwiseParallel(output_layouts=Replicate())
        elif kind == "col":  # the LM head: logits stay split over the vocabulary (the loss is
            styles[path] = ColwiseParallel(use_local_output=False)  # vocabulary-parallel)
        else:
            styles[path] = RowwiseParallel()
    if traced:
        _register_cpu_attention_sharding()
        for region in _regions(model, layers, split):
            if any(_under(p, [region]) for p in split):
                styles[region] = Relayout(replicate_rest=True)
    return styles


def _regions(model: nn.Module, layers: list[str], split: dict[str, str]) -> list[str]:
    """The parameter-holding non-norm children of each layer (attention, MLP, MoE)."""
    out = []
    for name in layers:
        for child, module in model.get_submodule(name).named_children():
            if _has_params(module) and not _is_norm(module):
                out.append(f"{name}.{child}")
    return out


def _sequence_parallel_styles(model: nn.Module, plan: Plan, split: dict[str, str],
                              whole_logits: bool = False) -> dict[str, ParallelStyle]:
    """Megatron-SP: the residual stream between layers is a DTensor sharded on the sequence;
    norms run on their shard; each region all-gathers its input and its row-parallel output
    reduce-scatters; the LM head gathers the final norm's output."""
    order = [n for n, _ in model.named_modules()]
    layers = [n for n in layer_names(plan) if n in order]
    if not layers:
        raise PlanError("sequence parallelism needs the plan's layers in the model; re-plan "
                        "with constraints sequence_parallel=false")
    first = order.index(layers[0])
    last_inner = max(i for i, n in enumerate(order) if _under(n, [layers[-1]]))
    leaves = [(i, n, m) for i, (n, m) in enumerate(model.named_modules())
              if _has_params(m) and not list(m.children())]
    head_side = [(n, m) for i, n, m in leaves if i < first]
    tail_side = [(n, m) for i, n, m in leaves if i > last_inner]
    styles: dict[str, ParallelStyle] = {}
    # the embedding reduce-scatters straight onto the sequence shards when it alone makes the
    # stream; otherwise (token + position embeddings) the first layer takes its shard
    lone = len(head_side) == 1 and head_side[0][0] in split
    for name, module in head_side:
        if name not in split:
            continue
        if not isinstance(module, nn.Embedding):
            raise PlanError(f"the plan splits {name} before the first layer; sequence "
                            f"parallelism expects only embeddings there; re-plan with "
                            f"constraints sequence_parallel=false")
        styles[name] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(SEQ),
                                       use_local_output=False) if lone else \
            RowwiseParallel(input_layouts=Replicate())
    styles[layers[0]] = Relayout(inputs=(Replicate(), Shard(SEQ)))
    for region in _regions(model, layers, split):
        kinds = {k for p, k in split.items() if _under(p, [region])}
        # a split region takes the gathered input as a DTensor, so that its backward
        # reduce-scatters the input gradient; a replicated one computes on plain tensors
        styles[region] = Relayout(inputs=(Shard(SEQ), Replicate()), local_input="col" not in kinds,
                                  outputs=None if "row" in kinds else (Replicate(), Shard(SEQ)))
    for name in layers:
        for child, module in model.get_submodule(name).named_children():
            if _is_norm(module):
                styles[f"{name}.{child}"] = SequenceParallel(sequence_dim=SEQ)
    for path, kind in split.items():
        if _under(path, layers) is None:
            continue
        styles[path] = ColwiseParallel() if kind == "col" else \
            RowwiseParallel(output_layouts=Shard(SEQ), use_local_output=False)
    for name, module in tail_side:
        if _is_norm(module):
            styles[name] = SequenceParallel(sequence_dim=SEQ)
        elif split.get(name) == "col":
            styles[name] = ColwiseParallel(input_layouts=Shard(SEQ), output_layouts=Replicate()) \
                if whole_logits else ColwiseParallel(input_layouts=Shard(SEQ),
                                                     use_local_output=False)
        elif name in split:
            raise PlanError(f"the plan splits {name} by rows after the last layer; sequence "
                            f"parallelism expects a column-parallel or replicated LM head; "
                            f"re-plan with constraints sequence_parallel=false")
        else:
            styles[name] = Relayout(inputs=(Shard(SEQ), Replicate()), local_input=True)
    return styles


def _restore_leaves(stage: nn.Module, original: nn.Module, split: dict[str, str]) -> None:
    """Put the original nn.Linear / nn.Embedding back where a traced stage holds a graph
    module for a split leaf: PyTorch's TP styles accept only the real module types. The
    stage calls the leaf with its one input and shares the original's parameters."""
    for path in split:
        leaf = stage.get_submodule(path)
        if isinstance(leaf, (nn.Linear, nn.Embedding)):
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


@functools.cache
def _register_cpu_attention_sharding() -> None:
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


def reduce_partial_grads(params) -> None:
    """Sum pending (Partial) gradients into their parameter's layout, once per step.

    A sequence-parallel norm's weight is replicated, but each rank only saw its sequence
    shard, so its gradient comes out Partial; left so, every optimizer op and the clipping
    norm would all-reduce it again.
    """
    for p in params:
        g = p.grad
        if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
            p.grad = g.redistribute(g.device_mesh, p.placements)
