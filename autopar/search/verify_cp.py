"""Whether a plan's context parallelism runs on the model it was planned for.

The cost model prices cp for any model with attention; the runtime runs it where it can swap
the attention for the cp attention and hand out global positions: Hugging Face decoders whose
attention modules are causal (through transformers' attention interface) and autopar's GPT
with its fused attention call. The search proposes cp freely, so ``autopar.plan`` asks this
module before it returns a plan, as it does for tensor parallelism (:mod:`verify_tp`).
"""

from __future__ import annotations

from torch import nn

from autopar.models.gpt import GPT
from autopar.plan.plan import Plan


def context_parallel_refusal(model: nn.Module | None, plan: Plan) -> str | None:
    """Why ``plan``'s cp > 1 does not run on ``model`` (None when it does, when cp is 1, or
    when the model is not at hand: a shipped name, which autopar builds as a decoder)."""
    if plan.mesh.get("cp", 1) == 1:
        return None
    if plan.peft.get("method") == "rdrop":
        return "R-Drop's two passes with context parallelism's token-summed loss"
    if model is None:
        return None
    if isinstance(model, GPT):
        return None if model.cfg.fused_attention else (
            "context parallelism on a GPT that computes attention by hand (fused_attention=False)")
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "set_attn_implementation"):
        return (f"context parallelism on {type(model).__name__} (it hooks Hugging Face "
                f"decoders' and autopar's GPT's attention)")
    attentions = [m for m in model.modules()
                  if type(m).__name__.endswith("Attention") and hasattr(m, "config")]
    if not attentions or not all(getattr(m, "is_causal", False) for m in attentions):
        return f"context parallelism on {type(model).__name__} (it runs causal attention only)"
    if getattr(config, "attention_dropout", 0.0):
        return (f"context parallelism with attention dropout "
                f"({config.attention_dropout}: set the model's attention_dropout to 0)")
    return None
