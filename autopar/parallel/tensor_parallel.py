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

import inspect
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from autopar.capture.layer_graph import fused_parts, runs_from_graph
from autopar.errors import PlanError, SequenceParallelUnsupported
from autopar.ir.latent import LATENT_ATTENTION
from autopar.parallel.graph_tp import GraphParallel
from autopar.parallel.style_spec import REPLICATE, StyleSpec, shard
from autopar.parallel.tp_styles import (
    ColumnParallel,
    HeadSplit,
    KvHeadReplicated,
    RowParallel,
    SharedRotaryKey,
    WholeKvProjection,
    is_conv1d,
    localize_heads,
    output_dim,
)
from autopar.parallel.traced_stage import prepare_stage, stream_position
from autopar.peft import is_prefix_param
from autopar.plan import Plan
from autopar.plan.placement import shard_dims

SEQ = 1  # the sequence dimension of the (batch, sequence, hidden) residual stream
SHARD_SEQ = shard(SEQ)


def layer_names(plan: Plan) -> list[str]:
    """Module paths of the plan's repeated layers, in model order."""
    return plan.layers


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
    ``hidden_states=``) and the first tensor of its output (a plain tensor when
    ``local_output``: what a pipeline stage hands to the next one).

    PrepareModuleInput/Output need the call's exact arity and positional/keyword form, which
    differ between models; this touches only the hidden states. ``replicate_rest`` turns every
    other plain tensor input (rotary tables, masks) into a replicated DTensor so that a traced
    stage's DTensor arithmetic does not mix in plain tensors.
    """

    def __init__(self, *, inputs: tuple[Placement, Placement] | None = None,
                 outputs: tuple[Placement, Placement] | None = None,
                 local_input: bool = False, local_output: bool = False,
                 replicate_rest: bool = False) -> None:
        super().__init__()
        self.inputs, self.outputs = inputs, outputs
        self.local_input, self.local_output = local_input, local_output
        self.replicate_rest = replicate_rest

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        params = list(inspect.signature(module.forward).parameters.values())
        first = params[0].name if params and params[0].kind in (
            inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY) else None
        # a traced module (pipeline stage) takes its inputs in the trace's order
        position = stream_position(module) if self.inputs is not None else None
        rep = (Replicate(), Replicate(), False)

        def pre(_mod, args, kwargs):
            args, kwargs = list(args), dict(kwargs)
            key = (position if position is not None else 0) if args else \
                first if first in kwargs else None
            if self.replicate_rest:
                for i, a in enumerate(args):
                    args[i] = _relayout(a, device_mesh, *rep)
                kwargs = {k: _relayout(v, device_mesh, *rep) for k, v in kwargs.items()}
            if self.inputs is not None and key is not None:
                holder = args if isinstance(key, int) else kwargs
                holder[key] = _relayout(holder[key], device_mesh, *self.inputs, self.local_input)
            return tuple(args), kwargs

        def post(_mod, _args, output):
            if isinstance(output, (tuple, list)) and output:
                head = _relayout(output[0], device_mesh, *self.outputs, self.local_output)
                return type(output)([head, *output[1:]])
            return _relayout(output, device_mesh, *self.outputs, self.local_output)

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


def graph_layers(model: nn.Module, plan: Plan) -> list[str]:
    """The plan's layers that run from their own graph under tensor parallelism
    (:class:`~autopar.parallel.graph_tp.GraphParallel`): those with a split parameter whose
    class is neither a Hugging Face model's nor autopar's (whose module styles are tested per
    family). Their Python code may read whole sizes or use weights outside their modules."""
    present = dict(model.named_modules())
    out = []
    for name in layer_names(plan):
        module = present.get(name)
        if module is None or not runs_from_graph(module):
            continue
        if shard_dims(plan.placements["params"], name):
            out.append(name)
    return out


def _graph_style(plan: Plan, layer: str) -> str:
    """The GraphParallel expression of one layer: its split parameters and fused parts."""
    params = shard_dims(plan.placements["params"], layer)
    fused = fused_parts(plan.placements.get("fused", {}), params, layer)
    return StyleSpec("GraphParallel", params, fused) if fused else StyleSpec("GraphParallel", params)


def _split(model: nn.Module, plan: Plan, tied: set[str]) -> dict[str, str]:
    """path -> "col" | "row" for the modules of ``model`` whose weight the plan splits over tp
    (tied weights stay replicated: one Parameter cannot carry two layouts)."""
    present = dict(model.named_modules())
    out = {}
    for fqn, placement in plan.param_placements().items():
        if not fqn.endswith(".weight") or not placement.splits_over_tp:
            continue
        path = fqn[: -len(".weight")]
        if path in tied or path not in present:
            continue
        # the stored weight's output-feature dimension: 0 for nn.Linear, 1 for Conv1D
        out[path] = "kv" if placement.kv_heads else \
            "col" if placement.tp_dim == output_dim(present[path]) else "row"
    return out


def _check_every_parameter_placed(model: nn.Module, plan: Plan,
                                  aliases: set[str] | frozenset[str] = frozenset()) -> None:
    """Refuse a plan whose placements.params leaves out a parameter of ``model``: under tp
    the rest of its module's split assumes it (a projection left whole beside its split
    siblings trains different numbers, or fails inside DTensor), so a hand edit that drops one
    must not be read as "replicate it"."""
    placed = plan.placements.get("params") or {}
    missing = [name for name, _ in model.named_parameters()
               if name not in placed and name not in aliases]
    if missing:
        raise PlanError(f"placements.params does not place {missing[0]}"
                        + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
                        + "; restore the entry or re-plan with autopar compile")


def _check_kind(path: str, module: nn.Module) -> None:
    if not isinstance(module, (nn.Linear, nn.Embedding)) and not is_conv1d(module):
        raise PlanError(f"the plan splits {path} ({type(module).__name__}) over tp, but only "
                        f"nn.Linear, Conv1D and nn.Embedding can be split; pin tp=1")


def _under(path: str, prefixes: list[str]) -> str | None:
    return next((p for p in prefixes if path == p or path.startswith(p + ".")), None)


@dataclass
class TensorParallelLayout:
    """What tensor parallelism does to a model, as source text: ``styles`` maps a module path
    to the ParallelStyle expression ``parallelize_module`` gets (the generated program prints
    these lines as they are; :func:`apply_layout` evaluates the same text), ``heads`` maps a
    split attention module to its (query heads, key/value heads, head size), and ``leaves``
    lists the split modules a traced pipeline stage must get back as real modules."""

    styles: dict[str, str] = field(default_factory=dict)
    heads: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    leaves: list[str] = field(default_factory=list)
    fused: dict[str, list[int]] = field(default_factory=dict)  # traced: outputs cut locally
    traced: bool = False


def tensor_parallel_layout(model: nn.Module, plan: Plan, *, traced: bool = False,
                           tied: set[str] | None = None, whole_logits: bool = False,
                           aliases: set[str] | frozenset[str] = frozenset()
                           ) -> TensorParallelLayout:
    """The plan's column/row/vocabulary-parallel modules (from its parameter placements), and
    Megatron sequence parallelism when ``plan.sequence_parallel``, for ``model`` (on meta).

    ``traced``: the styles are for pipeline stages traced from ``model`` (the layers'
    column-parallel outputs then stay DTensors so that the shapes the trace baked into its
    views stay global). ``tied`` names the tied modules (default: ``model``'s).
    ``whole_logits`` makes a column-parallel LM head gather its output (for a caller's own
    loss) instead of leaving it split for a vocabulary-parallel loss. ``aliases``: parameters
    of a model whose ties a pipeline undid (each alias its own copy), which the plan does not
    place.
    """
    _check_every_parameter_placed(model, plan, aliases)
    tied = tied_modules(model) if tied is None else tied
    graphed = graph_layers(model, plan)
    if graphed and plan.sequence_parallel:
        raise SequenceParallelUnsupported(
            f"sequence parallelism for layers run from their graph ({graphed[0]}: "
            f"a {type(model.get_submodule(graphed[0])).__name__}) is not supported "
            f"yet; re-plan with constraints sequence_parallel=false")
    split = {p: k for p, k in _split(model, plan, tied).items() if _under(p, graphed) is None}
    for path in split:
        _check_kind(path, model.get_submodule(path))
    fused = {p: parts for p, parts in plan.placements.get("fused", {}).items()
             if split.get(p) == "col"}
    layout = TensorParallelLayout(traced=traced)
    if traced:
        _check_stage_regions(model, plan, split)
        layout.leaves = sorted(split)  # a stage may hold any of them as a graph module
        layout.fused = dict(sorted(fused.items()))
    else:
        present = dict(model.named_modules())
        for path, heads in plan.placements.get("heads", {}).items():
            if path in present and _under(path, graphed) is None and any(k in ("col", "kv") and _under(p, [path])
                                       for p, k in split.items()):
                layout.heads[path] = tuple(heads)
    if plan.sequence_parallel and traced:
        styles = _stage_sequence_parallel_styles(model, plan, split, fused)
    elif plan.sequence_parallel:
        styles = _sequence_parallel_styles(model, plan, split, fused, whole_logits)
    else:
        styles = _tensor_parallel_styles(model, plan, split, fused, traced, whole_logits)
    for path in _head_split(model, plan):  # Prefix Tuning's prefixes, split by heads
        styles[path] = StyleSpec("HeadSplit")
    for path in layout.heads:  # latent attention: its shared rotary key's gradient summed
        if type(model.get_submodule(path)).__name__ in LATENT_ATTENTION:
            styles[path] = StyleSpec("SharedRotaryKey")
    for layer in graphed:
        styles[layer] = _graph_style(plan, layer)
    layout.styles = _in_model_order(model, styles)
    return layout


def _head_split(model: nn.Module, plan: Plan) -> list[str]:
    """Modules whose parameters the plan splits by heads (Prefix Tuning's prefixes)."""
    present = dict(model.named_modules())
    return sorted({fqn.rpartition(".")[0] for fqn, placement in plan.param_placements().items()
                   if is_prefix_param(fqn) and placement.splits_over_tp
                   and fqn.rpartition(".")[0] in present})


def build_styles(styles: dict[str, StyleSpec]) -> dict[str, ParallelStyle]:
    """The ParallelStyle objects a layout's style records describe (built by calling the
    listed constructors: nothing is evaluated)."""
    names = {"GraphParallel": GraphParallel, "RowwiseParallel": RowwiseParallel,
             "SequenceParallel": SequenceParallel, "ColumnParallel": ColumnParallel,
             "RowParallel": RowParallel, "KvHeadReplicated": KvHeadReplicated,
             "WholeKvProjection": WholeKvProjection, "HeadSplit": HeadSplit,
             "SharedRotaryKey": SharedRotaryKey,
             "Relayout": Relayout, "Replicate": Replicate, "Shard": Shard}
    return {path: spec.build(names) for path, spec in styles.items()}


def apply_layout(model: nn.Module, layout: TensorParallelLayout, tp_mesh: DeviceMesh,
                 original: nn.Module | None = None) -> None:
    """Apply ``layout`` to ``model`` (a whole model, or a traced stage of ``original``): local
    head counts for split attention, the original leaf modules back in a traced stage, then
    ``parallelize_module`` with the styles of the modules ``model`` holds."""
    present = dict(model.named_modules())
    for path, heads in layout.heads.items():
        if path in present:
            localize_heads(present[path], list(heads), tp_mesh.size())
    if original is not None:
        prepare_stage(model, original, layout.leaves, layout.fused)
    styles = {p: s for p, s in layout.styles.items() if p in present}
    if styles:
        parallelize_module(model, tp_mesh, build_styles(styles))


def apply_tensor_parallel(model: nn.Module, plan: Plan, tp_mesh: DeviceMesh, *,
                          tied: set[str] | None = None, original: nn.Module | None = None,
                          whole_logits: bool = False) -> list[str]:
    """:func:`tensor_parallel_layout` applied (:func:`apply_layout`) to ``model``, the whole
    model or a stage traced from ``original``. Returns the module paths it split."""
    base = original if original is not None else model
    layout = tensor_parallel_layout(base, plan, traced=original is not None, tied=tied,
                                    whole_logits=whole_logits)
    apply_layout(model, layout, tp_mesh, original)
    present = dict(model.named_modules())
    return sorted(p for p in _split(base, plan, tied if tied is not None
                                    else tied_modules(base)) if p in present)


def _tensor_parallel_styles(model: nn.Module, plan: Plan, split: dict[str, str],
                            fused: dict[str, list[int]], traced: bool, whole_logits: bool = False
                            ) -> dict[str, str]:
    layers = [n for n in layer_names(plan) if n in dict(model.named_modules())]
    styles: dict[str, str] = {}
    for path, kind in split.items():
        module = model.get_submodule(path)
        in_layer = _under(path, layers) is not None
        parts = [fused[path]] if path in fused else []
        if isinstance(module, nn.Embedding):
            styles[path] = StyleSpec("RowwiseParallel", input_layouts=REPLICATE)
        elif kind == "kv":
            styles[path] = StyleSpec("WholeKvProjection") if traced else _kv_style(plan, path)
        elif kind == "col" and in_layer:
            styles[path] = StyleSpec("ColumnParallel", *parts, use_local_output=not traced)
        elif kind == "col" and (traced or whole_logits):  # whole logits: a pipeline's last
            # stage, or a caller's own loss
            styles[path] = StyleSpec("ColumnParallel", output_layouts=REPLICATE)
        elif kind == "col":  # the LM head: logits stay split over the vocabulary (the loss is
            styles[path] = StyleSpec("ColumnParallel", use_local_output=False)  # vocab-parallel)
        else:
            styles[path] = StyleSpec("RowParallel")
    if traced:
        for region in _regions(model, layers, split):
            if any(_under(p, [region]) for p in split):
                styles[region] = StyleSpec("Relayout", replicate_rest=True)
    return _in_model_order(model, styles)


def _kv_style(plan: Plan, path: str) -> StyleSpec:
    """The kv-head-replicated style of a key/value projection, sized by its attention's heads."""
    for attention, (_, kv, head_dim) in plan.placements.get("heads", {}).items():
        if _under(path, [attention]):
            return StyleSpec("KvHeadReplicated", int(kv), int(head_dim))
    raise PlanError(f"the plan replicates kv heads in {path} but records no attention heads "
                    f"for it; re-plan it with this autopar version")


def _in_model_order(model: nn.Module, styles: dict[str, str]) -> dict[str, str]:
    order = {n: i for i, (n, _) in enumerate(model.named_modules())}
    return dict(sorted(styles.items(), key=lambda kv: order[kv[0]]))


def _norm_styles(model: nn.Module, layers: list[str]) -> dict[str, str]:
    """Each layer's norms run on their sequence shard (Megatron-SP)."""
    return {f"{name}.{child}": StyleSpec("SequenceParallel", sequence_dim=SEQ) for name in layers
            for child, module in model.get_submodule(name).named_children() if _is_norm(module)}


def _regions(model: nn.Module, layers: list[str], split: dict[str, str]) -> list[str]:
    """The parameter-holding non-norm children of each layer (attention, MLP, MoE)."""
    out = []
    for name in layers:
        for child, module in model.get_submodule(name).named_children():
            if _has_params(module) and not _is_norm(module):
                out.append(f"{name}.{child}")
    return out


def _sequence_parallel_styles(model: nn.Module, plan: Plan, split: dict[str, str],
                              fused: dict[str, list[int]], whole_logits: bool = False
                              ) -> dict[str, str]:
    """Megatron-SP: the residual stream between layers is a DTensor sharded on the sequence;
    norms run on their shard; each region all-gathers its input and its row-parallel output
    reduce-scatters; the LM head gathers the final norm's output."""
    order = [n for n, _ in model.named_modules()]
    layers = [n for n in layer_names(plan) if n in order]
    if not layers:
        raise SequenceParallelUnsupported(
            "sequence parallelism needs the plan's layers in the model; re-plan "
            "with constraints sequence_parallel=false")
    first = order.index(layers[0])
    last_inner = max(i for i, n in enumerate(order) if _under(n, [layers[-1]]))
    leaves = [(i, n, m) for i, (n, m) in enumerate(model.named_modules())
              if _has_params(m) and not list(m.children())]
    head_side = [(n, m) for i, n, m in leaves if i < first]
    tail_side = [(n, m) for i, n, m in leaves if i > last_inner]
    styles: dict[str, str] = {}
    # the embedding reduce-scatters straight onto the sequence shards when it alone makes the
    # stream; otherwise (token + position embeddings) the first layer takes its shard
    lone = len(head_side) == 1 and head_side[0][0] in split
    for name, module in head_side:
        if name not in split:
            continue
        if not isinstance(module, nn.Embedding):
            raise SequenceParallelUnsupported(
                f"the plan splits {name} before the first layer; sequence "
                f"parallelism expects only embeddings there; re-plan with "
                f"constraints sequence_parallel=false")
        styles[name] = StyleSpec("RowwiseParallel", input_layouts=REPLICATE,
                                 output_layouts=SHARD_SEQ, use_local_output=False) if lone else \
            StyleSpec("RowwiseParallel", input_layouts=REPLICATE)
    styles[layers[0]] = StyleSpec("Relayout", inputs=(REPLICATE, SHARD_SEQ))
    for region in _regions(model, layers, split):
        kinds = {k for p, k in split.items() if _under(p, [region])}
        _check_whole_parts(model, region, split, kinds)
        # a split region takes the gathered input as a DTensor, so that its backward
        # reduce-scatters the input gradient; a replicated one computes on plain tensors
        outputs = None if "row" in kinds else (REPLICATE, SHARD_SEQ)
        local = not {"col", "kv"} & kinds
        styles[region] = StyleSpec("Relayout", inputs=(SHARD_SEQ, REPLICATE), local_input=local,
                                   outputs=outputs)
    styles.update(_norm_styles(model, layers))
    for path, kind in split.items():
        if _under(path, layers) is None:
            continue
        if kind == "kv":
            styles[path] = _kv_style(plan, path)
            continue
        styles[path] = (StyleSpec("ColumnParallel", fused[path]) if path in fused
                        else StyleSpec("ColumnParallel")) if kind == "col" else \
            StyleSpec("RowParallel", output_layouts=SHARD_SEQ, use_local_output=False)
    for name, module in tail_side:
        if _is_norm(module):
            styles[name] = StyleSpec("SequenceParallel", sequence_dim=SEQ)
        elif split.get(name) == "col":
            styles[name] = StyleSpec("ColumnParallel", input_layouts=SHARD_SEQ,
                                     output_layouts=REPLICATE) if whole_logits else \
                StyleSpec("ColumnParallel", input_layouts=SHARD_SEQ, use_local_output=False)
        elif name in split:
            raise SequenceParallelUnsupported(
                f"the plan splits {name} by rows after the last layer; sequence "
                f"parallelism expects a column-parallel or replicated LM head; "
                f"re-plan with constraints sequence_parallel=false")
        else:
            styles[name] = StyleSpec("Relayout", inputs=(SHARD_SEQ, REPLICATE), local_input=True)
    return _in_model_order(model, styles)


def _check_stage_regions(model: nn.Module, plan: Plan, split: dict[str, str]) -> None:
    """Refuse, inside pipeline stages, a region that splits some of its modules and keeps
    another whole (besides norms): a traced stage computes the region on DTensors, which the
    whole module's plain weights cannot join (a router and experts beside a split shared
    expert, latent attention's down-projection beside its split heads). The search keeps such
    regions whole under pipelines."""
    layers = [n for n in layer_names(plan) if n in dict(model.named_modules())]
    covered = [*split, *_head_split(model, plan)]
    for region in _regions(model, layers, split):
        if not any(_under(p, [region]) for p in split):
            continue
        full = _whole_module(model, region, covered)
        if full is not None:
            raise PlanError(f"the plan splits some of {region}'s modules inside pipeline "
                            f"stages but keeps {full} whole, which a traced stage cannot "
                            f"run; re-plan (the search keeps such a region whole under "
                            f"pipelines) or pin pp=1")


def _whole_module(model: nn.Module, region: str, covered: list[str]) -> str | None:
    """The first module of ``region`` with weights of its own (not a norm) that no path of
    ``covered`` holds, or None."""
    for path, module in model.get_submodule(region).named_modules():
        full = f"{region}.{path}" if path else region
        if list(module.children()) or not _has_params(module) or _is_norm(module):
            continue
        if _under(full, covered) is None:
            return full
    return None


def _check_whole_parts(model: nn.Module, region: str, split: dict[str, str],
                       kinds: set[str]) -> None:
    """Refuse a split region that also holds a module kept whole (besides norms): under
    sequence parallelism the region takes the gathered sequence as a DTensor, which such a
    module (a MoE router or its experts beside a split shared expert) cannot compute with."""
    if not kinds:
        return
    full = _whole_module(model, region, list(split))
    if full is not None:
        raise SequenceParallelUnsupported(
            f"sequence parallelism in {region}: the plan splits some of its modules but keeps "
            f"{full} whole, which cannot take the gathered sequence; re-plan with constraints "
            f"sequence_parallel=false")


def _stage_sequence_parallel_styles(model: nn.Module, plan: Plan, split: dict[str, str],
                                    fused: dict[str, list[int]]) -> dict[str, str]:
    """Megatron-SP inside pipeline stages traced from ``model``: within a stage the residual
    stream between layers is sharded on the sequence, as :func:`_sequence_parallel_styles`
    lays it out, but stages exchange whole activations (the shapes the trace gave the
    pipeline's send and receive buffers): each stage's first layer takes its sequence shard
    of the whole input, and its last layer gathers its output back to a whole plain tensor.
    The embeddings and the tail (final norm, LM head) run as under plain traced tensor
    parallelism, on whole activations. Inside a layer everything stays a DTensor of global
    shape, so that the sizes the trace baked into its views hold."""
    order = [n for n, _ in model.named_modules()]
    layers = [n for n in layer_names(plan) if n in order]
    styles = {p: s for p, s in _tensor_parallel_styles(model, plan, split, fused, True).items()
              if _under(p, layers) is None}
    for region in _regions(model, layers, split):
        kinds = {k for p, k in split.items() if _under(p, [region])}
        outputs = None if "row" in kinds else (REPLICATE, SHARD_SEQ)
        if kinds:  # split: every input a replicated DTensor (the stream gathered), so that
            # the backward reduce-scatters the stream's gradient
            styles[region] = StyleSpec("Relayout", outputs=outputs, replicate_rest=True) \
                if outputs is not None else StyleSpec("Relayout", replicate_rest=True)
        else:  # replicated: computes on the whole plain input
            styles[region] = StyleSpec("Relayout", inputs=(SHARD_SEQ, REPLICATE),
                                       local_input=True, outputs=outputs)
    styles.update(_norm_styles(model, layers))
    for path, kind in split.items():
        if _under(path, layers) is None:
            continue
        parts = [fused[path]] if path in fused else []
        styles[path] = StyleSpec("ColumnParallel", *parts, use_local_output=False) \
            if kind == "col" else StyleSpec("WholeKvProjection") if kind == "kv" else \
            StyleSpec("RowParallel", output_layouts=SHARD_SEQ, use_local_output=False)
    styles.update(chunk_boundary_styles(plan, layers))
    return _in_model_order(model, styles)


def chunk_boundary_styles(plan: Plan, layers: list[str] | None = None) -> dict[str, StyleSpec]:
    """Sequence parallelism in traced pipeline stages: each chunk's first layer takes its
    sequence shard of the whole input it receives, and its last layer gathers its output back
    whole for the next stage. ``layers``: the plan's layers (default: all of them)."""
    layers = layer_names(plan) if layers is None else layers
    blocks = [b["name"] for b in plan.model["blocks"]]
    styles: dict[str, StyleSpec] = {}
    for start, end in plan.chunk_ranges():
        mine = [b for b in blocks[start:end] if b in layers]
        if not mine:
            continue
        scatter = {"inputs": (REPLICATE, SHARD_SEQ)}
        gather = {"outputs": (SHARD_SEQ, REPLICATE), "local_output": True}
        if mine[0] == mine[-1]:
            styles[mine[0]] = StyleSpec("Relayout", **scatter, **gather)
        else:
            styles[mine[0]] = StyleSpec("Relayout", **scatter)
            styles[mine[-1]] = StyleSpec("Relayout", **gather)
    return styles


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
