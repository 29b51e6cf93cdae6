"""Hugging Face models from shipped (or user) config files, built on the meta device."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from autopar.errors import CaptureError

CONFIG_DIR = Path(__file__).resolve().parent / "configs"


def list_models() -> list[str]:
    """Names of the shipped model configs (``llama3-8b``, ``tiny-mixtral``, ...)."""
    return sorted(p.stem for p in CONFIG_DIR.glob("*.json"))


def load_config(spec: str | Path) -> dict:
    """A config dict from a shipped name, a ``config.json`` path, or a folder holding one."""
    path = Path(spec)
    if path.is_dir():
        path = path / "config.json"
    elif not path.suffix and not path.exists():
        path = CONFIG_DIR / f"{spec}.json"
    if not path.is_file():
        raise CaptureError(
            f"no model config '{spec}': not a shipped name and no such file; use one of "
            f"{', '.join(list_models())}, a config.json path, or a folder holding one"
        )
    try:
        cfg = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CaptureError(f"cannot read model config {path}: {exc}; fix the JSON") from None
    if not isinstance(cfg, dict) or "model_type" not in cfg:
        raise CaptureError(
            f"{path} is not a Hugging Face config (no 'model_type'); pass a model's config.json"
        )
    return cfg


def _torch_dtype(cfg: dict) -> torch.dtype:
    name = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    dtype = getattr(torch, str(name), None)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


def build_model(spec: str | Path | dict, device: str | torch.device = "meta",
                dtype: torch.dtype | None = None) -> nn.Module:
    """Instantiate a causal LM from its config on ``device`` (meta: no memory for weights)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg_dict = dict(spec) if isinstance(spec, dict) else load_config(spec)
    dtype = dtype or _torch_dtype(cfg_dict)
    model_type = cfg_dict.pop("model_type")
    architectures = cfg_dict.get("architectures")
    for key in ("dtype", "torch_dtype", "architectures", "transformers_version"):
        cfg_dict.pop(key, None)
    try:
        config = AutoConfig.for_model(model_type, **cfg_dict)
    except (ValueError, KeyError) as exc:
        raise CaptureError(f"unsupported model_type '{model_type}': {exc}; use a model type "
                           f"that transformers knows") from None
    config.use_cache = False
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config)
    except ValueError as exc:
        if "Unrecognized configuration class" not in str(exc):
            raise
        kind = architectures[0] if isinstance(architectures, list) and architectures \
            else type(config).__name__
        raise CaptureError(f"a {model_type} config ({kind}) is not a causal language model, "
                           f"which is what autopar builds from a Hugging Face config "
                           f"(encoder-decoders such as T5 and vision models are not supported "
                           f"from config.json); build it yourself and pass a "
                           f"'module:factory'") from None
    finally:
        torch.set_default_dtype(old)
    return model


def max_positions(cfg: dict) -> int:
    return int(cfg.get("max_position_embeddings") or cfg.get("n_positions") or 2048)


def token_inputs(batch: int, seq: int, device: str | torch.device = "meta") -> tuple[torch.Tensor]:
    """Example ``(input_ids,)`` for a causal LM."""
    return (torch.zeros(batch, seq, dtype=torch.long, device=device),)


def is_conv1d(module: nn.Module) -> bool:
    """GPT-2's Conv1D (transformers.pytorch_utils), or a subclass of it (LoRA's): a linear
    that stores its weight (in, out)."""
    w = getattr(module, "weight", None)
    return any(c.__name__ == "Conv1D" for c in type(module).__mro__) and \
        hasattr(module, "nf") and isinstance(w, torch.Tensor) and w.dim() == 2

