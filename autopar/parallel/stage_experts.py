"""Expert parallelism inside traced pipeline stages.

A pipeline stage is traced from the whole model, so its experts modules are graph modules
that bake in the trace's token count and the grouped-mm kernel; expert parallelism needs the
real module (its all-to-all dispatch sends a different number of tokens each step). The
original experts module goes back in place of its traced copy, called with the same three
tensors, and is then made expert-parallel as in an unsplit model.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from autopar.errors import PlanError
from autopar.parallel.expert_parallel import (
    ExpertParallelExperts,
    find_experts,
    split_experts_at,
)


def restore_experts(stage: nn.Module, original: nn.Module) -> list[str]:
    """Put each experts module of ``original`` back where ``stage`` holds its traced copy;
    returns their paths. The parent's graph calls it with its inputs in the forward's order
    (hidden_states, top_k_index, top_k_weights), which the trace does not promise: the call
    is reordered by the traced inputs' shapes and dtypes."""
    present = dict(stage.named_modules())
    restored = []
    for path in find_experts(original):
        traced = present.get(path)
        if traced is None or isinstance(traced, ExpertParallelExperts):
            continue
        module = original.get_submodule(path)
        if traced is not module:
            _call_in_forward_order(stage, path, traced)
            parent, _, child = path.rpartition(".")
            setattr(stage.get_submodule(parent) if parent else stage, child, module)
        restored.append(path)
    return restored


def _call_in_forward_order(stage: nn.Module, path: str, traced: nn.Module) -> None:
    """Reorder the parent graph's call of the traced experts ``path`` to forward order."""
    parent_name, _, child = path.rpartition(".")
    parent = stage.get_submodule(parent_name) if parent_name else stage
    graph = getattr(parent, "graph", None)
    calls = [n for n in graph.nodes if n.op == "call_module" and n.target == child] \
        if isinstance(graph, torch.fx.Graph) else []
    inputs = [n for n in traced.graph.nodes if n.op == "placeholder"] \
        if isinstance(getattr(traced, "graph", None), torch.fx.Graph) else []
    order = _forward_order([n.meta.get("val") for n in inputs])
    if len(calls) != 1 or calls[0].kwargs or len(calls[0].args) != 3 or order is None:
        raise PlanError(f"the traced pipeline stage calls the experts {path} in a form "
                        f"expert parallelism cannot wrap (not once, with hidden states, "
                        f"expert indices and weights); re-plan with ep=1 or pp=1")
    call = calls[0]
    call.args = tuple(call.args[i] for i in order)
    # an unflattened InterpreterModule keeps its generated code outside _modules
    code = parent if isinstance(parent, torch.fx.GraphModule) else \
        parent.__dict__.get("graph_module")
    if code is not None:
        code.recompile()


def _forward_order(values: list) -> list[int] | None:
    """Positions of (hidden_states, top_k_index, top_k_weights) among a traced experts
    module's inputs, told apart by their example values: the one integer tensor is the
    expert index, the float tensor shaped like it the weights; None when ambiguous."""
    if len(values) != 3 or not all(isinstance(v, torch.Tensor) for v in values):
        return None
    index = [i for i, v in enumerate(values) if not v.is_floating_point()]
    if len(index) != 1:
        return None
    rest = [i for i in range(3) if i != index[0]]
    shape = values[index[0]].shape
    weights = [i for i in rest if values[i].shape == shape]
    if len(weights) != 1:
        return None
    hidden = next(i for i in rest if i != weights[0])
    return [hidden, index[0], weights[0]]


def stage_expert_parallel(stage: nn.Module, original: nn.Module, ep_mesh: DeviceMesh
                          ) -> list[ExpertParallelExperts]:
    """The experts of a traced stage, restored and split over ``ep_mesh`` (in place); none
    when the stage holds no experts."""
    return split_experts_at(stage, restore_experts(stage, original), ep_mesh, original)


def check_stage_experts(stages: list[nn.Module], original_paths: list[str]) -> None:
    """Refuse laid-out stages that still hold an experts module whole under a plan that
    splits experts: their ranks would train different copies of the same experts."""
    wanted = set(original_paths)
    for stage in stages:
        for path, module in stage.named_modules():
            # recompute wraps a layer: its experts' path gains the wrapper's attribute
            plain = ".".join(p for p in path.split(".") if p != "_checkpoint_wrapped_module")
            if plain in wanted and not isinstance(module, ExpertParallelExperts):
                raise PlanError(f"the plan splits experts over ep but this pipeline stage "
                                f"holds {path} whole (its lay-out did not apply expert "
                                f"parallelism); re-plan with ep=1")
