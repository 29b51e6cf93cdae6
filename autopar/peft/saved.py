"""Adapter folders: only the trained weights of a fine-tuning run, ``adapter_model.safetensors``
beside ``adapter_config.json``.

LoRA and Prefix Tuning are written in Hugging Face ``peft``'s layout, so
``PeftModel.from_pretrained(base, folder)`` loads them: LoRA factors as
``base_model.model.<module>.lora_A.weight``; the prefixes as one ``prompt_embeddings``
[num_virtual_tokens, layers * 2 * kv_heads * head_dim] (peft's PrefixEncoder without
projection: per layer its keys, then its values). Methods peft lacks (Adapter,
LowRankAdapter, BitFit) keep autopar's parameter names under peft's ``base_model.model.``
prefix, and their config is autopar's settings. :func:`load_adapter` reads any of them back
onto a base model.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from autopar.errors import PlanError
from autopar.models.hf import is_conv1d
from autopar.peft import apply_peft
from autopar.peft.config import PeftConfig, parse_peft

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model."  # peft's name for the wrapped model


def _prefix_modules(model: nn.Module) -> list[str]:
    """The prefix modules (one per attention layer), in layer order."""
    return [n for n, m in model.named_modules() if hasattr(m, "prefix_key")]


def adapter_files(model: nn.Module, config: PeftConfig, trained: dict[str, torch.Tensor]
                  ) -> tuple[dict[str, torch.Tensor], dict]:
    """The tensors and config of ``config``'s adapter folder for ``model`` (transformed by
    :func:`autopar.peft.apply_peft`), from its trained tensors by autopar name."""
    base = getattr(getattr(model, "config", None), "_name_or_path", None) or None
    if config.method == "lora":
        tensors = {f"{PREFIX}{n}.weight": t for n, t in trained.items()}
        owners = {n.rpartition(".")[0] for n in trained}
        targets = sorted({o.rpartition(".")[2] for o in owners})
        conv1d = any(is_conv1d(model.get_submodule(o)) for o in owners)
        return tensors, {
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": config.r,
            "lora_alpha": config.lora_alpha, "lora_dropout": config.lora_dropout,
            "target_modules": config.target_modules if isinstance(config.target_modules, str)
            else targets, "use_rslora": config.use_rslora, "bias": "none",
            "fan_in_fan_out": conv1d, "init_lora_weights": True, "inference_mode": True,
            "modules_to_save": None, "base_model_name_or_path": base}
    if config.method == "prefix_tuning":
        layers = _prefix_modules(model)
        per_layer = [t for m in layers for t in (trained[f"{m}.prefix_key"],
                                                 trained[f"{m}.prefix_value"])]
        stacked = torch.stack(per_layer)  # [layers * 2, kv_heads, tokens, head_dim]
        kv_heads, tokens, head_dim = stacked.shape[1:]
        embeddings = stacked.permute(2, 0, 1, 3).reshape(tokens, -1).contiguous()
        return {"prompt_embeddings": embeddings}, {
            "peft_type": "PREFIX_TUNING", "task_type": "CAUSAL_LM",
            "num_virtual_tokens": tokens, "token_dim": kv_heads * head_dim,
            "num_transformer_submodules": 1, "num_attention_heads": kv_heads,
            "num_layers": len(layers), "encoder_hidden_size": kv_heads * head_dim,
            "prefix_projection": False, "inference_mode": True,
            "base_model_name_or_path": base}
    if config.method == "rdrop":
        raise PlanError("R-Drop trains every weight, so it has no adapter; export the whole "
                        "model (autopar export DIR --to hf OUT writes it)")
    return {f"{PREFIX}{n}": t for n, t in trained.items()}, config.to_dict()


def save_adapter(folder: str | Path, tensors: dict[str, torch.Tensor], config: dict) -> None:
    """Write an adapter folder's two files into ``folder`` (which must exist)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / WEIGHTS_FILE),
              metadata={"format": "pt"})
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")


def load_adapter(model: nn.Module, folder: str | Path) -> PeftConfig:
    """Apply the adapter folder's method to ``model`` (in place) and load its weights: a
    folder autopar exported, or a LoRA / Prefix Tuning adapter peft saved. Returns the
    method's settings."""
    from safetensors.torch import load_file

    folder = Path(folder)
    if not (folder / CONFIG_FILE).is_file() or not (folder / WEIGHTS_FILE).is_file():
        raise PlanError(f"{folder} is not an adapter folder (it needs {CONFIG_FILE} and "
                        f"{WEIGHTS_FILE}); pass the folder autopar export wrote")
    config = parse_peft(folder / CONFIG_FILE)
    apply_peft(model, config)
    saved = load_file(str(folder / WEIGHTS_FILE))
    if config.method == "prefix_tuning":
        layers = _prefix_modules(model)
        sample = model.get_submodule(layers[0]).prefix_key
        kv_heads, tokens, head_dim = sample.shape
        want = (tokens, len(layers) * 2 * kv_heads * head_dim)
        got = tuple(saved["prompt_embeddings"].shape)
        if got != want:
            raise PlanError(f"{folder}: prompt_embeddings is {list(got)}, this model's prefix "
                            f"needs {list(want)}; load it onto the base model it was trained "
                            f"from")
        per_layer = saved["prompt_embeddings"].reshape(
            tokens, len(layers) * 2, kv_heads, head_dim).permute(1, 2, 0, 3)
        state = {f"{m}.prefix_{kind}": per_layer[2 * i + j]
                 for i, m in enumerate(layers) for j, kind in enumerate(("key", "value"))}
    else:
        state = {k.removeprefix(PREFIX).removesuffix(".weight") if config.method == "lora"
                 else k.removeprefix(PREFIX): v for k, v in saved.items()}
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    missing, unknown = trained - set(state), set(state) - trained
    if missing or unknown:
        name = sorted(missing or unknown)[0]
        raise PlanError(f"{folder} does not fit this model ({name} is "
                        f"{'missing' if missing else 'not a trained parameter'}); load it onto "
                        f"the base model it was trained from")
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in state.items():
            if tuple(value.shape) != tuple(params[name].shape):
                raise PlanError(f"{folder}: {name} is {list(value.shape)}, the model's is "
                                f"{list(params[name].shape)}; load it onto the base model it "
                                f"was trained from")
            params[name].copy_(value)
    return config
