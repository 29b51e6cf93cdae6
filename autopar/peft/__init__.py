"""Parameter-efficient fine-tuning: each method is a transform of the model that freezes the
base weights and adds (or unfreezes) the few it trains. The planner captures the transformed
model, so its per-parameter trainable flags drive gradient and optimizer memory, gradient
communication and weight-gradient FLOPs; the runtime applies the same transform before
laying the model out."""

from __future__ import annotations

from torch import nn

from autopar.errors import PlanError
from autopar.peft.adapter import ADAPTER_PARAMS, AdapterLinear
from autopar.peft.config import METHODS, PeftConfig, parse_peft
from autopar.peft.lora import LORA_PARAMS, LoraLinear, apply_lora

# parameters a method adds to the model (absent from the base model's checkpoint)
ADDED_PARAMS = (*LORA_PARAMS, *ADAPTER_PARAMS)


def apply_peft(model: nn.Module, config: PeftConfig | dict | str) -> list[str]:
    """Transform ``model`` in place for ``config``'s method; returns the names of the
    parameters it trains."""
    config = parse_peft(config)
    if config.method == "lora":
        apply_lora(model, config)
    elif config.method == "bitfit":
        from autopar.peft.bitfit import apply_bitfit

        apply_bitfit(model, config)
    elif config.method in ("adapter", "low_rank_adapter"):
        from autopar.peft.adapter import apply_adapter

        apply_adapter(model, config, low_rank=config.method == "low_rank_adapter")
    else:
        raise PlanError(f"the {config.method} method is not in autopar yet; use lora, bitfit, "
                        f"adapter or low_rank_adapter")
    return [n for n, p in model.named_parameters() if p.requires_grad]


def is_added_param(fqn: str) -> bool:
    """Whether ``fqn`` is a parameter a fine-tuning method added (not in the base model)."""
    return fqn.rsplit(".", 1)[-1] in ADDED_PARAMS


__all__ = ["METHODS", "AdapterLinear", "LoraLinear", "PeftConfig", "apply_peft",
           "is_added_param", "parse_peft"]
