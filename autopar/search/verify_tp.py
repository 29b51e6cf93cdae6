"""The search proposes no tensor-parallel layout that does not run: before a plan with tp > 1
is returned, each layer that would run from its own graph (a model that is neither a Hugging
Face model nor autopar's) is split as the plan places its parameters, rewritten for one rank
and executed on meta (:func:`autopar.capture.layer_graph.check_layer_split`). Module-styled
layers (Hugging Face decoders, autopar's GPT) are the families the runtime's tests cover.

The layers' inputs come from one forward of the model on meta (its parameters swapped for
meta tensors, so a model with real weights is not copied).
"""

from __future__ import annotations

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.func import functional_call

from autopar.capture.layer_graph import (
    check_layer_split,
    fused_parts,
    meta_like,
    runs_from_graph,
)
from autopar.errors import AutoparError
from autopar.models.spec import is_factory, load_factory
from autopar.plan import Plan
from autopar.plan.placement import shard_dims


def model_and_inputs(model: object, example_inputs: object) -> tuple[nn.Module, tuple] | None:
    """The nn.Module behind what ``autopar.plan`` was given, with example inputs, when it can
    run from its graph at all (a user's module or a ``module:factory``); None otherwise."""
    if isinstance(model, nn.Module):
        inputs = example_inputs if isinstance(example_inputs, tuple) else (
            () if example_inputs is None else (example_inputs,))
        return model, inputs
    if isinstance(model, str):
        if is_factory(model):
            with torch.device("meta"):
                return load_factory(model)
    return None


def tensor_parallel_refusal(model: nn.Module, inputs: tuple, plan: Plan
                            ) -> tuple[str, dict] | None:
    """Why ``plan``'s tensor-parallel layout does not run on ``model`` and the pins that
    avoid it (``sequence_parallel=False``, else ``tp=1``), or None when it runs."""
    tp = plan.mesh["tp"]
    if tp == 1:
        return None
    present = dict(model.named_modules())
    layers = {}
    for name in plan.layers:
        layer = present.get(name)
        if layer is None or not runs_from_graph(layer):
            continue
        if shard_dims(plan.placements["params"], name):
            layers[name] = layer
    if not layers:
        return None
    if plan.sequence_parallel:
        first = next(iter(layers))
        return (f"{first}: sequence parallelism for layers run from their graph (a "
                f"{type(layers[first]).__name__}) is not supported yet",
                {"sequence_parallel": False})
    calls: dict[str, tuple] = {}
    hooks = [layer.register_forward_pre_hook(
        lambda _m, args, kwargs, name=name: calls.setdefault(name, (args, kwargs)),
        with_kwargs=True) for name, layer in layers.items()]
    state = {n: meta_like(t) for n, t in (*model.named_parameters(), *model.named_buffers())}
    try:
        with torch.no_grad():
            functional_call(model, state, pytree.tree_map_only(torch.Tensor, meta_like, inputs))
    except Exception as exc:  # noqa: BLE001 - a model that does not run on meta: not checked
        return None if not isinstance(exc, AutoparError) else (str(exc), {"tp": 1})
    finally:
        for hook in hooks:
            hook.remove()
    checked = set()
    for name, layer in layers.items():
        params = shard_dims(plan.placements["params"], name)
        fused = fused_parts(plan.placements.get("fused", {}), params, name)
        key = (type(layer), tuple(params.items()), tuple((k, tuple(v)) for k, v in fused.items()))
        if key in checked or name not in calls:
            continue
        checked.add(key)
        try:
            check_layer_split(layer, params, fused, tp, *calls[name])
        except AutoparError as exc:
            return f"{name}: {exc}", {"tp": 1}
    return None
