"""A layer's own graph for tensor parallelism: which layers run from it, their export on meta,
which split parameter each linear reads, and the check that a planned split runs (the graph
rewritten for one rank's shards and executed on meta, before a plan is written).

Shared by the search (it proposes no tensor-parallel layout that fails this check) and the
runtime (:mod:`autopar.parallel.graph_tp` runs the same rewritten graph on real shards).
"""

from __future__ import annotations

import copy

import torch
import torch.utils._pytree as pytree
from torch import fx, nn
from torch.export.graph_signature import InputKind

from autopar.capture.einsum_projection import node_projection
from autopar.capture.layer_split import Collectives, Refused, split_graph
from autopar.errors import PlanError

# classes whose layers keep module styles (tested per family): everything else runs from
# its graph under tensor parallelism
MODULE_STYLED = ("transformers.", "autopar.")


def runs_from_graph(layer: nn.Module) -> bool:
    """Whether tensor parallelism runs ``layer`` from its own graph (any class that is
    neither a Hugging Face model's nor autopar's)."""
    return not type(layer).__module__.startswith(MODULE_STYLED)


def fused_parts(fused: dict[str, list[int]], params: dict[str, int], layer: str
                ) -> dict[str, list[int]]:
    """The fused parts (plan.yaml's ``placements.fused``: by module path, the split parameters
    it owns directly; by parameter name, an einsum projection's bare weight) by parameter name
    relative to ``layer``."""
    out = {}
    for module_path, parts in fused.items():
        if module_path == layer or module_path.startswith(layer + "."):
            rel = module_path[len(layer) + 1:]
            if rel in params:  # a parameter's own entry
                out[rel] = list(parts)
                continue
            for name in params:
                if name.rpartition(".")[0] == rel:
                    out[name] = list(parts)
    return out


def export_layer(layer: nn.Module, args: tuple, kwargs: dict, training: bool):
    """``layer`` (whole shapes) exported on meta at the shapes of ``args``/``kwargs``."""
    template = copy.deepcopy(layer).to("meta")
    template.train(training)
    meta = pytree.tree_map_only(torch.Tensor, meta_like, (tuple(args), dict(kwargs)))
    try:
        # no autograd while tracing: a first call inside activation checkpointing would
        # otherwise count the trace's saved tensors against the recomputation's
        with torch.no_grad(), torch.autocast("cpu", enabled=False):
            return torch.export.export(template, meta[0], meta[1], strict=False)
    except Exception as exc:  # noqa: BLE001 - any export failure is the same refusal
        raise PlanError(f"tensor parallelism could not trace a {type(layer).__name__} layer "
                        f"({type(exc).__name__}: {str(exc).splitlines()[0][:160]}); re-plan "
                        f"with constraints tp=1") from None


def meta_like(t: torch.Tensor) -> torch.Tensor:
    """A meta tensor of ``t``'s (local) shape and dtype."""
    local = t.to_local() if hasattr(t, "to_local") else t
    return torch.empty(local.shape, dtype=t.dtype, device="meta",
                       requires_grad=t.requires_grad)


def linear_kinds(gm: fx.GraphModule, signature, params: dict[str, int],
                 fused: dict[str, list[int]], name: str):
    """(placeholder -> "col" | "row" | "bias", placeholder -> fused parts) for the split
    parameters, by the op that reads each (a linear, or an einsum projection split on its
    output or contracted index); a split the graph uses otherwise is refused."""
    by_target = {s.target: s.arg.name for s in signature.input_specs
                 if s.kind == InputKind.PARAMETER}
    nodes = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
    kinds, parts = {}, {}
    for param, dim in params.items():
        node = nodes.get(by_target.get(param, ""))
        if node is None:
            continue  # not read by this call (a branch not taken)
        for user in node.users:
            linear = user.target is torch.ops.aten.linear.default
            if linear and user.args[1] is node and dim in (0, 1):
                kinds[node.name] = "col" if dim == 0 else "row"
            elif linear and len(user.args) > 2 and user.args[2] is node and dim == 0:
                kinds.setdefault(node.name, "bias")
            elif (proj := node_projection(user, node)) is not None and \
                    dim in (proj.out_dim, proj.contracted_dim):
                kinds[node.name] = "col" if dim == proj.out_dim else "row"
            else:
                raise PlanError(f"the plan splits {param} of a {name} layer along dim {dim}, "
                                f"but the layer reads it in {user.target}, which a split "
                                f"cannot follow; re-plan with constraints tp=1")
        if param in fused:
            if node.users and kinds.get(node.name) not in ("col", "bias"):
                raise PlanError(f"the plan cuts {param} of a {name} layer into fused parts "
                                f"{list(fused[param])}, but splits it along its input "
                                f"features (dim {dim}); re-plan with autopar compile")
            parts[node.name] = tuple(fused[param])
    return kinds, parts


def split_layer_graph(program, params: dict[str, int], fused: dict[str, list[int]], tp: int,
                      collectives: Collectives, name: str) -> fx.GraphModule:
    """The exported layer's graph rewritten for one of ``tp`` ranks (PlanError, one line,
    when the split cannot be followed)."""
    gm = program.graph_module
    kinds, parts = linear_kinds(gm, program.graph_signature, params, fused, name)
    try:
        split_graph(gm, kinds, parts, tp, collectives)
    except Refused as exc:
        raise PlanError(f"tensor parallelism cannot split a {name} layer as planned: {exc}; "
                        f"re-plan with constraints tp=1") from None
    return gm


class _Identity(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def check_layer_split(layer: nn.Module, params: dict[str, int], fused: dict[str, list[int]],
                      tp: int, args: tuple, kwargs: dict) -> None:
    """Raise PlanError (one line) unless ``layer``, split as ``params``/``fused`` over ``tp``
    ranks, runs: its graph rewritten for one rank and executed on meta, its parameters at
    their local shapes (collectives are identities: shapes are what is checked)."""
    program = export_layer(layer, args, kwargs, layer.training)
    name = type(layer).__name__
    gm = split_layer_graph(program, params, fused, tp, Collectives(_Identity(), _Identity()),
                           name)
    signature = program.graph_signature
    flat = iter(pytree.tree_leaves((tuple(args), dict(kwargs))))
    inputs = []
    for spec in signature.input_specs:
        if spec.kind == InputKind.PARAMETER:
            param = layer.get_parameter(spec.target)
            shape = list(param.shape)
            dim = params.get(spec.target)
            if dim is not None:
                shape[dim] //= tp
            inputs.append(torch.empty(shape, dtype=param.dtype, device="meta"))
        elif spec.kind == InputKind.BUFFER:
            inputs.append(meta_like(layer.get_buffer(spec.target)))
        elif spec.kind == InputKind.CONSTANT_TENSOR:
            inputs.append(meta_like(program.constants[spec.target]))
        else:
            value = next(flat)
            inputs.append(meta_like(value) if isinstance(value, torch.Tensor) else value)
    try:
        with torch.no_grad():
            gm(*inputs)
    except Exception as exc:  # noqa: BLE001 - the rewritten graph does not run: refuse
        raise PlanError(f"tensor parallelism splits a {name} layer into a graph that does not "
                        f"run ({type(exc).__name__}: {str(exc).splitlines()[0][:160]}); re-plan "
                        f"with constraints tp=1") from None
