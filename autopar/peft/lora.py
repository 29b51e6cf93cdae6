"""LoRA: a trainable rank-r update beside each target linear, the base weight frozen.

:class:`LoraLinear` *is* the base ``nn.Linear`` (its ``weight`` and ``bias`` keep their names,
so a Hugging Face checkpoint of the base model loads as it is) with two more parameters:
``lora_A`` [r, in] and ``lora_B`` [out, r]. Its output is ``base(x) + B(A(dropout(x))) *
scaling``. ``B`` starts at zero, so the fine-tuned model starts as the base model (peft's
initialisation: A Kaiming-uniform, B zeros).
"""

from __future__ import annotations

import math
import re

import torch
import torch.nn.functional as F
from torch import nn

from autopar.errors import PlanError
from autopar.peft.config import PeftConfig

LORA_PARAMS = ("lora_A", "lora_B")


def adopt(base: nn.Linear, cls: type[nn.Linear]) -> nn.Linear:
    """``base`` itself as ``cls`` (a subclass adding trainable parts), its own weight and
    bias frozen and kept under their names."""
    base.__class__ = cls
    base.weight.requires_grad_(False)
    if base.bias is not None:
        base.bias.requires_grad_(False)
    return base


def merged(weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor,
           scaling: float) -> torch.Tensor:
    """A weight with its LoRA update folded in: ``W + scaling * B @ A``."""
    return weight + scaling * (lora_B @ lora_A)


class LoraLinear(nn.Linear):
    """An nn.Linear with a LoRA update; build it with :meth:`wrap`."""

    r: int
    scaling: float

    @classmethod
    def wrap(cls, base: nn.Linear, r: int, scaling: float, dropout: float) -> LoraLinear:
        """``base`` itself, turned into a LoraLinear (its parameters kept, frozen)."""
        module: LoraLinear = adopt(base, cls)  # type: ignore[assignment]
        module.r, module.scaling = r, scaling
        module.lora_dropout = nn.Dropout(dropout) if dropout else nn.Identity()
        device, dtype = module.weight.device, module.weight.dtype
        module.lora_A = nn.Parameter(torch.empty(r, module.in_features, device=device,
                                                 dtype=dtype))
        module.lora_B = nn.Parameter(torch.empty(module.out_features, r, device=device,
                                                 dtype=dtype))
        if device.type != "meta":
            module.reset_lora()
        return module

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if hasattr(self, "lora_A"):
            self.reset_lora()

    def reset_lora(self) -> None:
        with torch.no_grad():
            nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
            nn.init.zeros_(self.lora_B)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        update = F.linear(F.linear(self.lora_dropout(x), self.lora_A), self.lora_B)
        return F.linear(x, self.weight, self.bias) + update * self.scaling


def _output_head(model: nn.Module) -> nn.Module | None:
    getter = getattr(model, "get_output_embeddings", None)
    return getter() if callable(getter) else None


# peft's default targets per model type (its TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING):
# the attention's query and value projections, however the model names them
DEFAULT_TARGETS = {"llama": ("q_proj", "v_proj"), "mistral": ("q_proj", "v_proj"),
                   "mixtral": ("q_proj", "v_proj"), "qwen2": ("q_proj", "v_proj"),
                   "qwen2_moe": ("q_proj", "v_proj"), "gemma": ("q_proj", "v_proj"),
                   "gemma2": ("q_proj", "v_proj"), "phi3": ("qkv_proj",),
                   "gpt2": ("c_attn",), "gpt_neox": ("query_key_value",),
                   "deepseek_v2": ("q_proj", "v_proj")}


def target_names(model: nn.Module, targets: tuple[str, ...] | str | None) -> list[str]:
    """The linears LoRA wraps, as peft chooses them: a list names module-name suffixes, a
    string is a regex the whole name must match, "all-linear" is every linear but the output
    head; none given: peft's default for the model type (the query and value projections)."""
    head = _output_head(model)
    linears = {name: m for name, m in model.named_modules()
               if isinstance(m, nn.Linear) and name and m is not head}
    if targets is None:
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        targets = DEFAULT_TARGETS.get(model_type, ("q_proj", "v_proj"))
    if targets == "all-linear":
        return sorted(linears)
    if isinstance(targets, str):
        pattern = re.compile(targets)
        chosen = [n for n in linears if pattern.fullmatch(n)]
    else:
        chosen = [n for n in linears if any(n == t or n.endswith(f".{t}") for t in targets)]
    if not chosen:
        some = ", ".join(sorted({n.rsplit(".", 1)[-1] for n in linears})[:8])
        raise PlanError(f"LoRA target_modules {targets!r} match no linear layer of the model; "
                        f"its linears are named like {some}")
    return sorted(chosen)


def apply_lora(model: nn.Module, config: PeftConfig) -> list[str]:
    """Freeze ``model`` and wrap its target linears (in place); returns their names."""
    names = target_names(model, config.target_modules)
    model.requires_grad_(False)
    for name in names:
        LoraLinear.wrap(model.get_submodule(name), config.r, config.scaling,
                        config.lora_dropout)
    return names
