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


@pytest.fixture(scope="session")
def hf_folder(tmp_path_factory):
    """``hf_folder(name)``: a shipped tiny config saved with ``save_pretrained`` (random fp32
    weights from seed 0) in a session temp folder, once per name; returns the folder."""
    from autopar.models.hf import build_model

    saved: dict[str, object] = {}

    def make(name: str):
        if name not in saved:
            torch.manual_seed(0)
            model = build_model(name, device="cpu", dtype=torch.float32)
            folder = tmp_path_factory.mktemp(f"hf-{name}")
            model.save_pretrained(folder)
            saved[name] = folder
        return saved[name]

    return make
