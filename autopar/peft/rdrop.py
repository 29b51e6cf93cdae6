"""R-Drop (Liang et al. 2021, "R-Drop: Regularized Dropout for Neural Networks"): every
sequence goes through the model twice with different dropout masks, and the loss adds the
symmetric KL divergence of the two predictions to their cross-entropy. All weights train
(R-Drop regularises full fine-tuning).

As a transform of the model: a forward pre-hook stacks the batch on itself while training
(``[x; x]``), so one forward runs both passes (each row its own dropout draws), the captured
graph and the planner see the doubled work, and every plan (pipelines included) runs it
unchanged. The loss (:func:`rdrop_loss`) splits the logits back into the two passes. A model
with no dropout gets ``dropout`` on its dropout layers and attention dropout, since R-Drop
without dropout is plain training.
"""

from __future__ import annotations

import torch
from torch import nn

from autopar.peft.config import PeftConfig

RDROP_ATTR = "_autopar_rdrop_alpha"  # on the model: the KL weight its loss uses


def _twice(module: nn.Module, args: tuple, kwargs: dict):
    """In training mode: the batch stacked on itself (capture traces a training-mode model
    without autograd, so the mode alone decides)."""
    if not module.training:
        return args, kwargs
    if args:
        return (torch.cat([args[0], args[0]]), *args[1:]), kwargs
    key = "input_ids" if kwargs.get("input_ids") is not None else "inputs_embeds"
    return args, {**kwargs, key: torch.cat([kwargs[key], kwargs[key]])}


def _add_dropout(model: nn.Module, p: float) -> int:
    """Set ``p`` on the model's dropout layers and attention-dropout rates that are zero;
    returns how many it set."""
    changed = 0
    for module in model.modules():
        if isinstance(module, nn.Dropout) and module.p == 0:
            module.p = p
            changed += 1
        rate = getattr(module, "attention_dropout", None)
        if type(rate) is float and rate == 0:  # transformers' attention modules
            module.attention_dropout = p
            changed += 1
    return changed


def apply_rdrop(model: nn.Module, config: PeftConfig) -> list[str]:
    """Make ``model`` run each batch twice while training (all weights train); returns the
    names of the parameters it trains."""
    model.requires_grad_(True)
    _add_dropout(model, config.dropout)
    setattr(model, RDROP_ATTR, float(config.rdrop_alpha))
    model.register_forward_pre_hook(_twice, with_kwargs=True)
    return [n for n, _ in model.named_parameters()]
