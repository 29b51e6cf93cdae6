"""Parameter-efficient fine-tuning: each method is a transform of the model that freezes the
base weights and adds (or unfreezes) the few it trains. The planner captures the transformed
model, so its per-parameter trainable flags drive gradient and optimizer memory, gradient
communication and weight-gradient FLOPs; the runtime applies the same transform before
laying the model out."""

from __future__ import annotations

from functools import partial

from torch import nn

from autopar.peft.adapter import ADAPTER_PARAMS, AdapterLinear, apply_adapter
from autopar.peft.bitfit import apply_bitfit
from autopar.peft.config import METHODS, PeftConfig, parse_peft
from autopar.peft.lora import LORA_PARAMS, LoraLinear, apply_lora
from autopar.peft.prefix import PREFIX_PARAMS, PrefixKV, apply_prefix_tuning
from autopar.peft.rdrop import apply_rdrop

_APPLY = {"lora": apply_lora, "prefix_tuning": apply_prefix_tuning, "adapter": apply_adapter,
          "low_rank_adapter": partial(apply_adapter, low_rank=True), "bitfit": apply_bitfit,
          "rdrop": apply_rdrop}
assert set(_APPLY) == set(METHODS)

# parameters a method adds to the model (absent from the base model's checkpoint)
ADDED_PARAMS = (*LORA_PARAMS, *ADAPTER_PARAMS, *PREFIX_PARAMS)


def apply_peft(model: nn.Module, config: PeftConfig | dict | str) -> list[str]:
    """Transform ``model`` in place for ``config``'s method; returns the names of the
    parameters it trains."""
    config = parse_peft(config)
    _APPLY[config.method](model, config)
    return [n for n, p in model.named_parameters() if p.requires_grad]


def is_added_param(fqn: str) -> bool:
    """Whether ``fqn`` is a parameter a fine-tuning method added (not in the base model)."""
    return fqn.rsplit(".", 1)[-1] in ADDED_PARAMS


def is_prefix_param(fqn: str) -> bool:
    """Whether ``fqn`` is a Prefix Tuning key or value prefix [kv_heads, tokens, head_dim]:
    under tensor parallelism it is split by heads with its attention."""
    return fqn.rsplit(".", 1)[-1] in PREFIX_PARAMS


__all__ = ["METHODS", "AdapterLinear", "LoraLinear", "PeftConfig", "PrefixKV", "apply_peft",
           "is_added_param", "is_prefix_param", "parse_peft"]
