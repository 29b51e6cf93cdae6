"""Prefix Tuning (Li & Liang 2021): each attention layer attends to ``num_virtual_tokens``
trained key/value vectors before the real tokens; the base model is frozen.

Each attention module gets a :class:`PrefixKV` child holding its layer's prefix as two
parameters, ``key`` and ``value`` [kv_heads, num_virtual_tokens, head_dim]: per layer, so a
pipeline stage holds its own layers' prefixes, and head-major, so tensor parallelism splits
them by heads with the attention (``Shard(0)``). The attention module's own config copy names
an attention function (registered with transformers' ``AttentionInterface``) that puts the
prefix in front of the keys and values and lets every real token see it, then calls the
model's own attention (sdpa or eager).

The semantics are peft's (``PrefixTuningConfig`` without projection): the prefix is the past
of the sequence, so the real tokens' positions start at ``num_virtual_tokens``, and the
parameter count is peft's ``num_virtual_tokens * layers * 2 * kv_heads * head_dim``.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from autopar.errors import PlanError
from autopar.peft.config import PeftConfig

PREFIX_PARAMS = ("prefix_key", "prefix_value")
ATTENTION_NAME = "autopar_prefix"  # the attention function's name in transformers' registry


class PrefixKV(nn.Module):
    """One layer's trained prefix: keys and values [kv_heads, tokens, head_dim]."""

    def __init__(self, kv_heads: int, tokens: int, head_dim: int, inner: str,
                 device: torch.device | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.inner = inner  # the model's own attention implementation (sdpa, eager)
        shape = (kv_heads, tokens, head_dim)
        self.prefix_key = nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
        self.prefix_value = nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
        if self.prefix_key.device.type != "meta":
            self.reset_parameters()

    @property
    def tokens(self) -> int:
        return self.prefix_key.shape[1]

    def reset_parameters(self) -> None:
        # peft's PrefixEncoder is an nn.Embedding: N(0, 1)
        with torch.no_grad():
            nn.init.normal_(self.prefix_key)
            nn.init.normal_(self.prefix_value)


def _local(prefix: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The prefix in the form the keys have: a head-split DTensor prefix becomes this rank's
    heads where the attention computes on plain local tensors."""
    from torch.distributed.tensor import DTensor

    if isinstance(prefix, DTensor) and not isinstance(like, DTensor):
        return prefix.to_local()
    return prefix


def _with_prefix_mask(mask: torch.Tensor | None, query: torch.Tensor, tokens: int,
                      kv_length: int) -> torch.Tensor:
    """The attention mask over [prefix, keys]: every query sees the whole prefix; over the
    real keys, the model's own mask (None: causal). Made with ``new_*`` from tensors the
    attention already has, so that in a traced pipeline stage under tensor parallelism,
    where those are DTensors, the new ones are too."""
    q_length = query.shape[2]
    if mask is None:
        mask = query.new_ones((q_length, kv_length), dtype=torch.bool).tril(
            kv_length - q_length)[None, None]
    mask = mask[..., -kv_length:] if mask.shape[-1] > kv_length else mask
    shape = (*mask.shape[:-1], tokens)
    seen = mask.new_ones(shape) if mask.dtype == torch.bool else mask.new_zeros(shape)
    return torch.cat([seen, mask], dim=-1)


def prefix_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                     value: torch.Tensor, attention_mask: torch.Tensor | None, **kwargs):
    """The model's attention over [prefix, keys] and [prefix, values]."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    prefix: PrefixKV = module.prefix
    batch = key.shape[0]
    prefix_key, prefix_value = _local(prefix.prefix_key, key), _local(prefix.prefix_value, value)
    if prefix_key.dtype != key.dtype:  # cast only when needed: a traced cast asserts the
        # tensor's metadata, an op DTensor cannot run in a tensor-parallel pipeline stage
        prefix_key, prefix_value = prefix_key.to(key.dtype), prefix_value.to(value.dtype)
    mask = _with_prefix_mask(attention_mask, query, prefix.tokens, key.shape[2])
    key = torch.cat([prefix_key.unsqueeze(0).expand(batch, -1, -1, -1), key], dim=2)
    value = torch.cat([prefix_value.unsqueeze(0).expand(batch, -1, -1, -1), value], dim=2)
    kwargs.pop("is_causal", None)
    return ALL_ATTENTION_FUNCTIONS[prefix.inner](module, query, key, value, mask,
                                                 is_causal=False, **kwargs)


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, prefix_attention)


def _attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The self-attention modules of the model's layers: attention classes holding a layer
    index and the model's config (what transformers' attention classes share)."""
    return [(name, m) for name, m in model.named_modules()
            if hasattr(m, "layer_idx") and getattr(m, "config", None) is not None and
            type(m).__name__.endswith("Attention")]


def kv_shape(model: nn.Module) -> tuple[int, int]:
    """(kv heads, head size) of the model's attention, as peft sizes the prefix."""
    config = model.config
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return getattr(config, "num_key_value_heads", None) or heads, head_dim


def _shift_positions(tokens: int):
    """A pre-hook giving the real tokens positions after the prefix (peft's: the prefix is
    the sequence's past); positions a caller passes (a generator's, from 0) move with them."""
    def hook(module, args, kwargs):
        if kwargs.get("position_ids") is not None:  # a caller's positions (a generator's)
            return args, {**kwargs, "position_ids": kwargs["position_ids"] + tokens}
        ids = args[0] if args else kwargs.get("input_ids")
        if ids is None:
            ids = kwargs["inputs_embeds"]
        # on the weights' device, as the model makes its own positions (a pipeline traces a
        # meta model on a real example)
        device = next(module.parameters()).device
        kwargs["position_ids"] = torch.arange(tokens, tokens + ids.shape[1],
                                              device=device).unsqueeze(0)
        return args, kwargs
    return hook


def apply_prefix_tuning(model: nn.Module, config: PeftConfig) -> list[str]:
    """Freeze ``model`` and give each self-attention a trained prefix; returns the attention
    modules' names."""
    attentions = _attention_modules(model)
    if not attentions or getattr(model, "config", None) is None:
        raise PlanError(f"prefix tuning needs a Hugging Face decoder whose attention modules "
                        f"transformers builds; {type(model).__name__} has none; use lora")
    _register()
    model.requires_grad_(False)
    kv_heads, head_dim = kv_shape(model)
    inner = model.config._attn_implementation or "eager"
    weight = next(model.parameters())
    for _, attention in attentions:
        attention.prefix = PrefixKV(kv_heads, config.num_virtual_tokens, head_dim, inner,
                                    device=weight.device, dtype=weight.dtype)
        attention.config = copy.copy(attention.config)
        attention.config._attn_implementation = ATTENTION_NAME
    model.register_forward_pre_hook(_shift_positions(config.num_virtual_tokens),
                                    with_kwargs=True)
    return [name for name, _ in attentions]
