"""The installed package finds its shipped data (run against a non-editable install in CI)."""

from __future__ import annotations

import autopar
from autopar._paths import data_dir
from autopar.models import list_models, load_config


def test_shipped_catalogs_are_found() -> None:
    assert data_dir("cost_models").is_dir()
    assert data_dir("strategies").is_dir()


def test_shipped_model_configs_load() -> None:
    names = list_models()
    for required in ("llama3-8b", "llama3-70b", "mistral-7b", "mixtral-8x7b", "qwen2-7b", "gpt2",
                     "tiny-llama", "tiny-mixtral"):
        assert required in names
    assert load_config("llama3-70b")["num_hidden_layers"] == 80


def test_public_names() -> None:
    for name in ("capture", "CaptureError", "InfeasibleError", "PlanError", "ir"):
        assert hasattr(autopar, name)
    assert issubclass(autopar.CaptureError, autopar.AutoparError)
