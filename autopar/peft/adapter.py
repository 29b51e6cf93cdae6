"""Adapter (Houlsby et al. 2019) and LowRankAdapter: a trainable bottleneck after the
attention and after the MLP, the base model frozen.

The bottleneck sits on the output projection of each attention and MLP
(:class:`AdapterLinear`, which *is* that ``nn.Linear``: the base weights keep their names):
``y = base(x); y + up(gelu(down(y)))``, with ``down`` [adapter_size, out] and ``up`` [out,
adapter_size]. ``up`` starts at zero, so the model starts as the base model.
LowRankAdapter (MindPet's, after Compacter, Mahabadi et al. 2021) factors each of the two
matrices into a product of rank ``low_rank_rank``: ``down = down_a @ down_b``, ``up = up_a @
up_b``. Under tensor parallelism the adapter reads the output projection's reduced output
(DTensor redistributes a row-parallel projection's partial sums first) and stays whole on
every rank.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from autopar.peft.config import PeftConfig
from autopar.peft.lora import adopt, target_names

ADAPTER_PARAMS = ("adapter_down", "adapter_up", "adapter_down_bias", "adapter_up_bias",
                  "adapter_down_a", "adapter_down_b", "adapter_up_a", "adapter_up_b")
# the attention's and the MLP's output projections, per model type
DEFAULT_TARGETS = {"llama": ("o_proj", "down_proj"), "mistral": ("o_proj", "down_proj"),
                   "qwen2": ("o_proj", "down_proj"), "phi3": ("o_proj", "down_proj"),
                   "gemma": ("o_proj", "down_proj"), "gemma2": ("o_proj", "down_proj"),
                   "gpt_neox": ("attention.dense", "dense_4h_to_h")}


class AdapterLinear(nn.Linear):
    """An output projection followed by a residual bottleneck; build it with :meth:`wrap`."""

    low_rank: int  # 0: full bottleneck matrices; k: each a product of rank k

    @classmethod
    def wrap(cls, base: nn.Linear, size: int, low_rank: int = 0) -> AdapterLinear:
        module: AdapterLinear = adopt(base, cls)  # type: ignore[assignment]
        module.low_rank = low_rank
        out, device, dtype = module.out_features, module.weight.device, module.weight.dtype

        def new(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, device=device, dtype=dtype))

        if low_rank:
            module.adapter_down_a, module.adapter_down_b = new(size, low_rank), new(low_rank, out)
            module.adapter_up_a, module.adapter_up_b = new(out, low_rank), new(low_rank, size)
        else:
            module.adapter_down, module.adapter_up = new(size, out), new(out, size)
        module.adapter_down_bias, module.adapter_up_bias = new(size), new(out)
        if device.type != "meta":
            module.reset_adapter()
        return module

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if hasattr(self, "adapter_up_bias"):
            self.reset_adapter()

    def reset_adapter(self) -> None:
        """Down: Kaiming-uniform; up: zero (the model starts as the base model)."""
        with torch.no_grad():
            downs = ("adapter_down_a", "adapter_down_b") if self.low_rank else ("adapter_down",)
            for name in downs:
                nn.init.kaiming_uniform_(getattr(self, name), a=math.sqrt(5))
            if self.low_rank:  # one zero factor makes the product zero
                nn.init.kaiming_uniform_(self.adapter_up_a, a=math.sqrt(5))
                nn.init.zeros_(self.adapter_up_b)
            else:
                nn.init.zeros_(self.adapter_up)
            nn.init.zeros_(self.adapter_down_bias)
            nn.init.zeros_(self.adapter_up_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        if self.low_rank:
            h = F.linear(F.linear(y, self.adapter_down_b), self.adapter_down_a,
                         self.adapter_down_bias)
            up = F.linear(F.linear(F.gelu(h), self.adapter_up_b), self.adapter_up_a,
                          self.adapter_up_bias)
        else:
            h = F.linear(y, self.adapter_down, self.adapter_down_bias)
            up = F.linear(F.gelu(h), self.adapter_up, self.adapter_up_bias)
        return y + up


def apply_adapter(model: nn.Module, config: PeftConfig, low_rank: bool = False) -> list[str]:
    """Freeze ``model`` and put a bottleneck after each attention and MLP output projection
    (``target_modules`` overrides which linears); returns their names."""
    targets = config.target_modules
    if targets is None:
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        targets = DEFAULT_TARGETS.get(model_type, ("o_proj", "down_proj"))
    names = target_names(model, targets)
    model.requires_grad_(False)
    for name in names:
        AdapterLinear.wrap(model.get_submodule(name), config.adapter_size,
                           config.low_rank_rank if low_rank else 0)
    return names
