"""Whether autopar's runtime can run context parallelism on a captured model.

The cost model prices cp for any model with attention; the runtime runs it where it can swap
the attention for the cp attention and hand out global positions: Hugging Face decoders whose
attention modules are causal (through transformers' attention interface) and autopar's GPT
with its fused attention call (:mod:`autopar.parallel.context_parallel`). Capture records the
answer on the graph (``Graph.context_parallel_refusal``), so that the search proposes cp only
where it runs and a pinned cp on any other model is refused before any search.
"""

from __future__ import annotations

from torch import nn

from autopar.models.gpt import GPT

NOT_A_MODULE = "a graph captured from no nn.Module (ONNX) has no attention module to swap"


def context_parallel_refusal(model: nn.Module) -> str | None:
    """Why the runtime cannot run context parallelism on ``model`` (one clause), or None."""
    if isinstance(model, GPT):
        return None if model.cfg.fused_attention else (
            "autopar's GPT computes attention by hand here (fused_attention=False)")
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "set_attn_implementation"):
        return (f"{type(model).__name__} is neither a Hugging Face decoder nor autopar's GPT, "
                f"whose attention the runtime swaps for the cp attention")
    attentions = [m for m in model.modules()
                  if type(m).__name__.endswith("Attention") and hasattr(m, "config")]
    if not attentions or not all(getattr(m, "is_causal", False) for m in attentions):
        return f"{type(model).__name__}'s attention is not causal (cp runs causal attention)"
    if getattr(config, "attention_dropout", 0.0):
        return (f"{type(model).__name__} has attention dropout ({config.attention_dropout}; "
                f"set the model's attention_dropout to 0)")
    return None
