"""Parameter-efficient fine-tuning: each method is a transform of the model that freezes the
base weights and adds (or unfreezes) the few it trains. The planner captures the transformed
model, so its per-parameter trainable flags drive gradient and optimizer memory, gradient
communication and weight-gradient FLOPs; the runtime applies the same transform before
laying the model out."""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from autopar.errors import PlanError
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

APPLIED_ATTR = "_autopar_peft"  # on the model: the method apply_peft applied

# parameters a method adds to the model (absent from the base model's checkpoint)
ADDED_PARAMS = (*LORA_PARAMS, *ADAPTER_PARAMS, *PREFIX_PARAMS)


def apply_peft(model: nn.Module, config: PeftConfig | dict | str) -> list[str]:
    """Transform ``model`` in place for ``config``'s method; returns the names of the
    parameters it trains."""
    config = parse_peft(config)
    if getattr(model, APPLIED_ATTR, None) is not None:
        raise PlanError(f"the model is already fine-tuned with {getattr(model, APPLIED_ATTR)}; "
                        f"apply one method once, to the base model")
    _APPLY[config.method](model, config)
    setattr(model, APPLIED_ATTR, config.method)
    return [n for n, p in model.named_parameters() if p.requires_grad]


def applied_method(model: nn.Module) -> str | None:
    """The fine-tuning method :func:`apply_peft` applied to ``model``, if any."""
    return getattr(model, APPLIED_ATTR, None)


def hold_frozen(model: nn.Module, dtype: torch.dtype) -> int:
    """Hold ``model``'s frozen floating-point parameters in ``dtype`` (the plan's parameter
    dtype): they get no gradient and no optimizer update, so they need no fp32 master copy;
    compute reads them in ``dtype`` anyway. Returns how many it cast (on meta: free)."""
    cast = 0
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if not p.requires_grad and p.is_floating_point() and p.dtype != dtype:
                module._parameters[name] = nn.Parameter(p.detach().to(dtype),
                                                        requires_grad=False)
                cast += 1
    return cast


def is_added_param(fqn: str) -> bool:
    """Whether ``fqn`` is a parameter a fine-tuning method added (not in the base model)."""
    return fqn.rsplit(".", 1)[-1] in ADDED_PARAMS


def is_prefix_param(fqn: str) -> bool:
    """Whether ``fqn`` is a Prefix Tuning key or value prefix [kv_heads, tokens, head_dim]:
    under tensor parallelism it is split by heads with its attention."""
    return fqn.rsplit(".", 1)[-1] in PREFIX_PARAMS


__all__ = ["METHODS", "AdapterLinear", "LoraLinear", "PeftConfig", "PrefixKV", "apply_peft",
           "applied_method", "hold_frozen",
           "is_added_param", "is_prefix_param", "parse_peft"]
