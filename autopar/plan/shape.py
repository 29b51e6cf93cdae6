"""A transformer's shape in engine-neutral words (hidden size, layers, heads, ...), read from a
Hugging Face config: what Megatron-LM's shape flags and MindFormers' ``model_config`` state,
and what constraints from those files are checked against."""

from __future__ import annotations

SHAPE_KEYS = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "ffn_hidden_size",
              "vocab_size", "seq_length")

# Hugging Face spells each quantity in a few ways (GPT-2's n_embd, ...); the first present wins
_NAMES = {"hidden_size": ("hidden_size", "n_embd", "d_model"),
          "num_layers": ("num_hidden_layers", "n_layer", "num_layers"),
          "num_heads": ("num_attention_heads", "n_head"),
          "num_kv_heads": ("num_key_value_heads",),
          "ffn_hidden_size": ("intermediate_size", "n_inner", "ffn_dim"),
          "vocab_size": ("vocab_size",)}


def model_shape(config: dict, seq_length: int | None = None) -> dict[str, int]:
    """The shape a Hugging Face ``config`` (a dict) states; keys it does not state are left
    out. Defaults follow transformers: kv heads = heads, GPT-2's MLP = 4 x hidden."""
    out: dict[str, int] = {}
    for key, names in _NAMES.items():
        value = next((config[n] for n in names if isinstance(config.get(n), int)), None)
        if value is not None:
            out[key] = int(value)
    if "num_heads" in out:
        out.setdefault("num_kv_heads", out["num_heads"])
    if "hidden_size" in out and config.get("model_type") == "gpt2":
        out.setdefault("ffn_hidden_size", 4 * out["hidden_size"])
    if seq_length:
        out["seq_length"] = int(seq_length)
    return out


def shape_mismatch(pinned: dict[str, int], actual: dict[str, int]) -> str | None:
    """The first quantity ``pinned`` states differently from ``actual`` (as text), or None.
    A quantity ``actual`` does not know is not judged."""
    for key in SHAPE_KEYS:
        if key in pinned and key in actual and int(pinned[key]) != int(actual[key]):
            return f"{key} {pinned[key]} (the model has {actual[key]})"
    return None
