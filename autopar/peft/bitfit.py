"""BitFit (Ben Zaken et al. 2022): only the bias terms train.

Every existing bias is unfrozen. A model whose linears have none (Llama, Mistral) would train
nothing, so, as MindPet's BitFit does, a zero bias is added to each target linear (the
attention and MLP projections; ``target_modules`` as LoRA reads it, "all-linear" by default):
the model starts as the base model.
"""

from __future__ import annotations

import torch
from torch import nn

from autopar.peft.config import PeftConfig
from autopar.peft.lora import target_names


def apply_bitfit(model: nn.Module, config: PeftConfig) -> list[str]:
    """Freeze ``model`` but its biases, adding zero biases where target linears lack one."""
    model.requires_grad_(False)
    for name in target_names(model, config.target_modules or "all-linear"):
        linear = model.get_submodule(name)
        if linear.bias is None:
            w = linear.weight
            linear.bias = nn.Parameter(torch.zeros(linear.out_features, device=w.device,
                                                   dtype=w.dtype))
    for name, p in model.named_parameters():
        if name.rsplit(".", 1)[-1] == "bias":
            p.requires_grad_(True)
    return [n for n, p in model.named_parameters() if p.requires_grad]
