"""What a model's modules say about their output widths and attention heads, without running
them: for checking a plan's ``fused`` and ``heads`` entries against the model it runs on."""

from __future__ import annotations

import torch
from torch import nn

from autopar.models.hf import is_conv1d

# the attribute names models give their whole-model head counts and head size, on the
# attention module itself or on its config (Hugging Face, GPT-2, GPT-NeoX, Falcon, torch's MHA)
_QUERY_HEADS = ("num_heads", "num_attention_heads", "n_head", "n_heads")
_KV_HEADS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads")
_HEAD_SIZE = ("qk_head_dim", "head_dim", "head_size")


def output_features(module: nn.Module) -> int | None:
    """The output features of a projection: nn.Linear's weight is (out, in), GPT-2's Conv1D
    stores (in, out), any other module's 2-D weight is taken as (out, in); None without one."""
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        return None
    return int(weight.shape[1] if is_conv1d(module) else weight.shape[0])


def _declared(module: nn.Module, names: tuple[str, ...]) -> int | None:
    """The first integer the module, else its config, holds under one of ``names``."""
    config = getattr(module, "config", None)
    for owner in (module, None if isinstance(config, nn.Module) else config):
        for name in names:
            value = getattr(owner, name, None) if owner is not None else None
            if isinstance(value, int) and not isinstance(value, bool):
                return value
    return None


def heads_mismatch(module: nn.Module, path: str, heads: list[int],
                   fused: dict[str, list[int]]) -> str | None:
    """Why [query heads, kv heads, head size] cannot be ``module``'s (at ``path``), from the
    counts it (or its config) declares and the widths of its projections; None when nothing
    it holds contradicts them."""
    q, kv, head_dim = heads
    for names, value, what in ((_QUERY_HEADS, q, "query heads"), (_KV_HEADS, kv,
                                                                  "key/value heads"),
                               (_HEAD_SIZE, head_dim, "head size")):
        declared = _declared(module, names)
        if declared is not None and declared != value:
            return f"the module declares {declared} {what}, the entry {value}"
    widths = {int(d) for p in module.parameters() if p.dim() == 2 for d in p.shape}
    widths |= {part for name, parts in fused.items()
               if name == path or name.startswith(path + ".") for part in parts}
    if widths and q * head_dim not in widths:
        return (f"{q} query heads of size {head_dim} make {q * head_dim} features, a width "
                f"none of its projections has ({', '.join(map(str, sorted(widths)))})")
    return None
