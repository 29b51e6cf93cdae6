"""Multi-head latent attention (DeepSeek-V2's MLA, arXiv:2405.04434 section 2.1): the facts the
cost model, the search and the runtime share about it.

MLA projects the hidden state down to one small latent per token (``kv_lora_rank`` wide) plus
one rotary key shared by every head (``qk_rope_head_dim`` wide), and up again to per-head keys
and values (``kv_b_proj``). Two consequences:

- **Tensor parallelism** splits the heads (``q_proj``/``q_b_proj`` and ``kv_b_proj``
  column-parallel, ``o_proj`` row-parallel) while the down-projection stays whole on every
  rank. The shared rotary key is broadcast to each rank's own heads (an ``expand`` of a
  one-head tensor), so each rank's gradient for it covers only its heads: the ranks' shares are
  summed (one all-reduce of that key's gradient), as for a column-parallel input.
- **Generation** caches the latent and the rotary key, not per-head keys and values
  (Hugging Face transformers >= 5 ``DeepseekV2Attention.forward``: ``cache.update`` runs on
  the compressed tensors), and re-expands the whole cache through ``kv_b_proj`` at every step.
  The cache is the same on every tensor-parallel rank (the latent is not split).
"""

from __future__ import annotations

# module classes whose latent attention autopar's runtime splits by heads (the broadcast rotary
# key's gradient summed, autopar.parallel.tp_styles.SharedRotaryKey); tested per class
LATENT_ATTENTION = frozenset({"DeepseekV2Attention"})

# Hugging Face model types with MLA, and the config fields that size its cache
_LATENT_MODEL_TYPES = frozenset({"deepseek_v2", "deepseek_v3"})


def latent_cache_width(config: dict | None) -> int | None:
    """Elements one attention layer caches per token under MLA (the latent plus the shared
    rotary key), or None for a model without latent attention."""
    if not config or config.get("model_type") not in _LATENT_MODEL_TYPES:
        return None
    rank, rope = config.get("kv_lora_rank"), config.get("qk_rope_head_dim")
    if not isinstance(rank, int) or not isinstance(rope, int):
        return None
    return rank + rope


def decompressed_cache_width(config: dict) -> int:
    """Elements per token per layer that caching MLA's expanded keys and values would hold
    (every head's key and value): what the latent cache saves against."""
    heads = int(config["num_attention_heads"])
    key = int(config["qk_nope_head_dim"]) + int(config["qk_rope_head_dim"])
    return heads * (key + int(config["v_head_dim"]))
