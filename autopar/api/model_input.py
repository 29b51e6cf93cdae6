"""What :class:`autopar.Trainer` was given as its model, resolved into what the planner reads,
the weights the run starts from and the tokenizer.

A model is one of:

* a shipped name (``"tiny-llama"``): built from its config with seeded weights; the shipped
  tiny configs come with a tiny tokenizer (256 tokens, autopar/models/tokenizers/tiny);
* a Hugging Face folder (``config.json``, and ``*.safetensors`` to start from its weights,
  its tokenizer when it holds one);
* an autopar artifact (``manifest.json``): its model with the weights of its latest
  checkpoint;
* an ``nn.Module``: its own weights (rank 0's, so that every rank starts alike).

Weights held in memory (a module, an artifact's checkpoint) are written once, by rank 0, as
``OUTPUT_DIR/init/model.safetensors``, which every rank then reads its slices of, as from
any Hugging Face checkpoint.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_model
from torch import nn

from autopar.errors import PlanError
from autopar.models.hf import load_config
from autopar.serve.generate import load_model

SHIPPED_TOKENIZER = Path(__file__).resolve().parent.parent / "models" / "tokenizers" / "tiny"


@dataclass
class ModelInput:
    """``plan_input``: what autopar.plan and autopar.compile read (a name, a config folder,
    or the module); ``module``: the weights to snapshot (None: ``init_from`` or seeded);
    ``init_from``: a safetensors folder the run starts from; ``tokenizer``: a folder or
    None; ``vocab``: the model's vocabulary size."""

    plan_input: object
    module: nn.Module | None
    init_from: Path | None
    tokenizer: Path | None
    vocab: int


def _vocab_of(config: object) -> int:
    vocab = getattr(config, "vocab_size", None)
    if vocab is None and isinstance(config, dict):
        vocab = config.get("vocab_size")
    return int(vocab or 0)


def resolve_model(model: object) -> ModelInput:
    """The :class:`ModelInput` of ``model`` (see the module docstring); a PlanError naming
    what was passed when it is none of those."""
    if isinstance(model, nn.Module):
        config = getattr(model, "config", None) or getattr(model, "cfg", None)
        return ModelInput(model, model, None, None, _vocab_of(config))
    if not isinstance(model, (str, Path)):
        raise PlanError(f"a model is an nn.Module, a shipped name, a Hugging Face folder or an "
                        f"autopar artifact; got {type(model).__name__}")
    path = Path(model)
    if (path / "manifest.json").is_file():

        module = load_model(path, torch.device("cpu"))  # its latest checkpoint's weights
        return ModelInput(module, module, None, None, _vocab_of(module.config))
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise PlanError(f"{path} holds no config.json or manifest.json; pass a Hugging "
                            f"Face model folder or an autopar artifact")

        weights = path if any(path.glob("*.safetensors")) else None
        tokenizer = path if (path / "tokenizer_config.json").is_file() else None
        return ModelInput(str(path), None, weights, tokenizer, _vocab_of(load_config(str(path))))

    config = load_config(str(model))  # a shipped name or config.json; a PlanError otherwise
    vocab = _vocab_of(config)
    shipped_fits = str(model).startswith("tiny-") and vocab >= _shipped_size()
    return ModelInput(str(model), None, None, SHIPPED_TOKENIZER if shipped_fits else None,
                      vocab)


def _shipped_size() -> int:

    vocab = json.loads((SHIPPED_TOKENIZER / "tokenizer.json").read_text())["model"]["vocab"]
    return len(vocab)


def snapshot_weights(module: nn.Module, folder: Path) -> Path:
    """``module``'s weights as ``folder/model.safetensors`` (shared tensors once), written
    under a temporary name and renamed into place."""

    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / "model.safetensors.tmp"
    save_model(module, str(tmp))
    tmp.replace(folder / "model.safetensors")
    return folder
