"""Fixtures shared by the runtime tests."""

from __future__ import annotations

import pytest

import autopar
from autopar.models import GPT, GPTConfig, token_inputs
from autopar.runtime.source import describe_source


@pytest.fixture(scope="module")
def gpt():
    """(source, captured graph) of a 2-layer plain GPT with a tied embedding and head."""
    cfg = GPTConfig(vocab_size=128, seq_len=32, d_model=64, n_layers=2, n_heads=4)
    model = GPT(cfg)
    return describe_source(model), autopar.capture(model, token_inputs(1, cfg.seq_len))
