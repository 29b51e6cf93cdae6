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
from autopar.models.hf import is_conv1d
from autopar.peft.config import PeftConfig

LORA_PARAMS = ("lora_A", "lora_B")


def adopt(base: nn.Module, cls: type) -> nn.Module:
    """``base`` itself as ``cls`` (a subclass adding trainable parts), its own weight and
    bias frozen and kept under their names."""
    base.__class__ = cls
    base.weight.requires_grad_(False)
    if base.bias is not None:
        base.bias.requires_grad_(False)
    return base


def merged(weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor,
           scaling: float, conv1d: bool = False) -> torch.Tensor:
    """A weight with its LoRA update folded in: ``W + scaling * B @ A`` (transposed for a
    Conv1D weight, stored [in, out])."""
    update = scaling * (lora_B @ lora_A)
    return weight + (update.T if conv1d else update)


class _Lora:
    """LoRA beside a linear layer (nn.Linear, or GPT-2's Conv1D, which stores its weight
    [in, out]); the factors are [r, in] and [out, r] either way. Build one with
    :meth:`wrap`."""

    r: int
    scaling: float

    @classmethod
    def wrap(cls, base: nn.Module, r: int, scaling: float, dropout: float) -> nn.Module:
        """``base`` itself, turned into this class (its parameters kept, frozen)."""
        module = adopt(base, cls)
        module.r, module.scaling = r, scaling
        module.lora_dropout = nn.Dropout(dropout) if dropout else nn.Identity()
        device, dtype = module.weight.device, module.weight.dtype
        fan_in, fan_out = linear_features(module)
        module.lora_A = nn.Parameter(torch.empty(r, fan_in, device=device, dtype=dtype))
        module.lora_B = nn.Parameter(torch.empty(fan_out, r, device=device, dtype=dtype))
        if device.type != "meta":
            module.reset_lora()
        return module

    def reset_parameters(self) -> None:
        base = getattr(super(), "reset_parameters", None)  # Conv1D has none (HF's init rule)
        if base is not None:
            base()
        if hasattr(self, "lora_A"):
            self.reset_lora()

    def reset_lora(self) -> None:
        with torch.no_grad():
            nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
            nn.init.zeros_(self.lora_B)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        update = F.linear(F.linear(self.lora_dropout(x), self.lora_A), self.lora_B)
        return super().forward(x) + update * self.scaling


class LoraLinear(_Lora, nn.Linear):
    """An nn.Linear with a LoRA update."""


def linear_features(module: nn.Module) -> tuple[int, int]:
    """(input, output) features of an nn.Linear or a Conv1D."""
    if is_conv1d(module):
        return module.weight.shape[0], module.weight.shape[1]
    return module.in_features, module.out_features


def lora_class(module: nn.Module) -> type:
    """LoraLinear for an nn.Linear; for a Conv1D, a LoRA subclass of its class."""
    if not is_conv1d(module):
        return LoraLinear
    base = type(module)
    return _CONV1D.setdefault(base, type("LoraConv1D", (_Lora, base), {
        "__doc__": "GPT-2's Conv1D with a LoRA update.", "__module__": __name__}))


_CONV1D: dict[type, type] = {}


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
               if (isinstance(m, nn.Linear) or is_conv1d(m)) and name and m is not head}
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
        module = model.get_submodule(name)
        lora_class(module).wrap(module, config.r, config.scaling, config.lora_dropout)
    return names
