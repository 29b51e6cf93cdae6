"""Shared fixtures: tiny models every test package uses."""

from __future__ import annotations

import pytest
import torch

from autopar.models import GPT, GPTConfig

TINY_HF = ["tiny-llama", "tiny-mistral", "tiny-mixtral", "tiny-qwen2", "tiny-gpt2"]


@pytest.fixture
def tiny_gpt_config() -> GPTConfig:
    return GPTConfig(vocab_size=256, seq_len=32, d_model=64, n_layers=2, n_heads=4)


@pytest.fixture
def tiny_gpt(tiny_gpt_config: GPTConfig) -> GPT:
    torch.manual_seed(0)
    return GPT(tiny_gpt_config)


@pytest.fixture
def token_ids(tiny_gpt_config: GPTConfig) -> torch.Tensor:
    return torch.randint(0, tiny_gpt_config.vocab_size, (2, tiny_gpt_config.seq_len))
