"""Context parallelism inside traced pipeline stages. A stage is a graph torch's tracer cut
from the whole model, so neither transformers' attention interface nor the SDPA wrapper of
:mod:`autopar.parallel.cp_sdpa` reaches its attention: each ``aten.scaled_dot_product_attention``
node of the stage's graphs is re-pointed at :func:`traced_cp_sdpa`, which runs the cp
attention of the module the node sits in. The model was traced on one cp rank's share of the
sequence with its global position ids as an input (:func:`trace_positions`); the first stage
gets them at run time from a forward pre-hook, so rotary tables (or learned positions) match
one process, and later stages receive what the first computed from them."""

from __future__ import annotations

import torch
from torch import nn

from autopar.errors import PlanError
from autopar.models.gpt import GPT, Attention
from autopar.parallel.context_parallel import (
    CP_ATTR,
    ContextParallel,
    check_sliding_window,
    context_parallel_for,
)
from autopar.parallel.cp_sdpa import (
    active_context_parallel,
    hook_module,
    outside_context_parallel,
)

_SDPA = torch.ops.aten.scaled_dot_product_attention.default


def position_keyword(model: nn.Module) -> str:
    """The forward keyword that takes the tokens' places in the whole sequence: autopar's
    GPT's ``positions``, Hugging Face decoders' ``position_ids``."""
    return "positions" if isinstance(model, GPT) else "position_ids"


def trace_positions(model: nn.Module, microbatch_size: int, local_tokens: int) -> dict:
    """The keyword input the pipeline tracer is given so that position ids become an input
    of the first stage instead of an ``arange`` over the local tokens baked into the trace."""
    # on the model's device: a meta model's rotary tables meet them during the trace
    device = next(model.parameters()).device
    ids = torch.arange(local_tokens, device=device).unsqueeze(0).expand(microbatch_size, -1)
    return {position_keyword(model): ids}


def apply_stage_context_parallel(stage: nn.Module, original: nn.Module, group, mode: str,
                                 tp: int = 1, all_to_all_ranks: int = 0) -> ContextParallel:
    """Lay a traced pipeline ``stage`` of ``original`` out for context parallelism over
    ``group``: its attention nodes run the cp attention, and (the first stage) its position
    input is filled with this rank's global positions. Returns the rank's ContextParallel,
    also recorded on the stage."""
    cp = context_parallel_for(original, group, mode, tp, all_to_all_ranks)
    found = 0
    for module in stage.modules():
        graph = getattr(module, "graph", None)
        if not isinstance(graph, torch.fx.Graph):
            continue
        nodes = [n for n in graph.nodes if n.op == "call_function" and n.target is _SDPA]
        for node in nodes:
            query = node.args[0].meta.get("val") if isinstance(node.args[0], torch.fx.Node) \
                else None
            if query is not None:  # the trace's local tokens, times cp: the whole sequence
                check_sliding_window(original, query.shape[-2] * cp.size)
            node.target = traced_cp_sdpa
        if nodes:
            _recompile(module)
            hook_module(module, cp)
            found += len(nodes)
    if not found and _holds_attention(stage, original):
        raise PlanError(f"context parallelism found no scaled_dot_product_attention in a "
                        f"traced pipeline stage of {type(original).__name__}; re-plan with "
                        f"constraints cp=1 or pp=1")
    _give_stage_positions(stage, cp, position_keyword(original))
    setattr(stage, CP_ATTR, cp)
    return cp


def _holds_attention(stage: nn.Module, original: nn.Module) -> bool:
    """Whether the stage holds a module traced from an attention module of ``original`` (a
    stage of only the embedding, or only the final norm and head, holds none)."""
    have = dict(original.named_modules())
    return any(path in have and _is_attention(have[path]) for path, _ in stage.named_modules())


def _is_attention(module: nn.Module) -> bool:
    return isinstance(module, Attention) or type(module).__name__.endswith("Attention")


def _recompile(module: nn.Module) -> None:
    # an unflattened InterpreterModule keeps its generated code outside _modules
    code = module if isinstance(module, torch.fx.GraphModule) else \
        module.__dict__.get("graph_module")
    if code is not None:
        code.recompile()


def _give_stage_positions(stage: nn.Module, cp: ContextParallel, name: str) -> None:
    """The first stage (the one whose graph takes the positions as an input) gets this rank's
    global positions, shaped as its token ids, when the caller passes none."""
    inputs = [n.name for n in stage.graph.nodes if n.op == "placeholder"] \
        if isinstance(getattr(stage, "graph", None), torch.fx.Graph) else []
    if name not in inputs:
        return
    index = inputs.index(name)

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if len(args) <= index and kwargs.get(name) is None:
            ids = args[0]
            kwargs[name] = cp.positions(ids.shape[1], ids.device).expand(ids.shape[0], -1)
        return args, kwargs

    stage.register_forward_pre_hook(hook, with_kwargs=True)


def traced_cp_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                   scale=None, enable_gqa=False):
    """A traced stage's ``aten.scaled_dot_product_attention``, run as the cp attention of the
    module it sits in. The trace materialized the causal mask of the local tokens (a plain
    causal model's only mask: cp refuses padding); any other mask is refused. Under tensor
    parallelism q, k and v are DTensors sharded on heads: the cp attention runs on the local
    heads."""
    cp = active_context_parallel()
    if cp is None:
        return _SDPA(query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                     enable_gqa=enable_gqa)
    if dropout_p:
        raise PlanError(f"context parallelism does not run attention dropout ({dropout_p}); "
                        f"set the model's attention dropout to 0")
    if not is_causal and not _hides_only_the_future(attn_mask):
        raise PlanError("context parallelism runs causal attention over whole sequences; this "
                        "traced stage's attention has another mask (padding) or none: re-plan "
                        "with constraints cp=1")
    from torch.distributed.tensor import DTensor

    with outside_context_parallel():
        if isinstance(query, DTensor):
            mesh, placements = query.device_mesh, query.placements
            out = cp.attend(query.to_local(), key.to_local(), value.to_local(), scale=scale)
            return DTensor.from_local(out, mesh, placements, run_check=False)
        return cp.attend(query, key, value, scale=scale)


def _hides_only_the_future(mask) -> bool:
    """Whether ``mask`` ((B, 1|H, S, S), boolean or additive) lets each query see itself and
    no later key. The trace built it from the position ids, and a cp rank's two chunks of
    the sequence are not contiguous, so Hugging Face's mask reads them as two packed
    sequences and hides the first chunk from the second: that mask passes, and the cp
    attention restores the whole sequence's causal view. Padding fails (a query that sees
    nothing); a sliding window is refused from the config (:func:`sliding_window_refusal`)."""
    if mask is None:
        return False
    from torch.distributed.tensor import DTensor

    if isinstance(mask, DTensor):
        mask = mask.full_tensor()
    s, t = mask.shape[-2:]
    if s != t:
        return False
    seen = mask if mask.dtype == torch.bool else mask == 0
    future = torch.ones(s, t, dtype=torch.bool, device=mask.device).triu(1)
    return not bool((seen & future).any()) and bool(seen.diagonal(dim1=-2, dim2=-1).all())
