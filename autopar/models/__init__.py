"""Shipped models: Hugging Face configs (built on meta) and a plain-PyTorch tiny GPT."""

from autopar.models.gpt import GPT, GPTConfig
from autopar.models.hf import build_model, list_models, load_config, max_positions, token_inputs

__all__ = ["GPT", "GPTConfig", "build_model", "list_models", "load_config", "max_positions",
           "token_inputs"]
