"""The graph cache: a config captured once is read back equal, plans the same, and is keyed by
everything the capture reads; a broken cache only costs the capture again."""

from __future__ import annotations

import gzip
import importlib
import json

import pytest
import torch

import autopar
from autopar.capture import cache
from autopar.ir.serialize import graph_from_dict, graph_to_dict, same_graph
from autopar.models.hf import load_config


@pytest.fixture
def folder(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("AUTOPAR_CACHE", raising=False)
    return tmp_path / "graphs"


def _captured(monkeypatch) -> list:
    """Records every real capture (torch.export) from here on."""
    calls: list = []
    package = importlib.import_module("autopar.capture")
    real = package._capture_module

    def counting(*args, **kwargs):
        calls.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(package, "_capture_module", counting)
    return calls


def test_a_second_capture_reads_the_cache_and_plans_the_same(folder, monkeypatch) -> None:
    calls = _captured(monkeypatch)
    first = autopar.capture("tiny-mixtral", seq=32)
    second = autopar.capture("tiny-mixtral", seq=32)
    assert len(calls) == 1 and len(list(folder.glob("*.json.gz"))) == 1
    assert second is not first and same_graph(first, second)
    kw = dict(devices=4, global_batch=8, constraints={"precision": "fp32"})
    a, b = autopar.plan(first, **kw).to_dict(), autopar.plan(second, **kw).to_dict()
    for d in (a, b):
        d.pop("solver")
    assert a == b


def test_the_key_holds_everything_the_capture_reads(folder, monkeypatch, tmp_path) -> None:
    calls = _captured(monkeypatch)
    autopar.capture("tiny-llama", seq=32)
    autopar.capture("tiny-llama", seq=16)
    autopar.capture("tiny-llama", seq=32, batch=2)
    autopar.capture("tiny-llama", seq=32, peft="lora")
    lora = autopar.capture("tiny-llama", seq=32, peft="lora")
    assert lora.peft["method"] == "lora"
    assert any(not p.trainable for p in lora.params.values())
    # the same config under another name is the same graph; one changed field is another
    cfg = load_config("tiny-llama")
    (tmp_path / "same").mkdir()
    (tmp_path / "same" / "config.json").write_text(json.dumps(cfg))
    autopar.capture(tmp_path / "same", seq=32)
    (tmp_path / "wider").mkdir()
    (tmp_path / "wider" / "config.json").write_text(json.dumps(dict(cfg, num_hidden_layers=3)))
    wider = autopar.capture(tmp_path / "wider", seq=32)
    assert len(calls) == 5
    assert len([b for b in wider.blocks if b.role == "layer"]) == 3
    keys = {cache.graph_key(cfg, 1, 32, None), cache.graph_key(cfg, 1, 16, None)}
    assert len(keys) == 2


def test_off_and_explicit_inputs_are_never_cached(folder, monkeypatch) -> None:
    monkeypatch.setenv("AUTOPAR_CACHE", "off")
    autopar.capture("tiny-gpt2", seq=16)
    assert not folder.exists()
    monkeypatch.delenv("AUTOPAR_CACHE")
    ids = torch.zeros(1, 16, dtype=torch.long, device="meta")
    autopar.capture("tiny-gpt2", ids)  # example inputs the key does not describe
    assert not folder.exists()


def test_a_broken_file_is_captured_again(folder, monkeypatch) -> None:
    calls = _captured(monkeypatch)
    good = autopar.capture("tiny-gpt2", seq=16)
    (path,) = folder.glob("*.json.gz")
    path.write_bytes(b"not gzip")
    assert same_graph(autopar.capture("tiny-gpt2", seq=16), good)
    with gzip.open(path, "wt") as f:  # valid JSON, not a graph
        json.dump({"format": 1, "ops": "x"}, f)
    assert same_graph(autopar.capture("tiny-gpt2", seq=16), good)
    assert len(calls) == 3


def test_a_graph_that_is_not_plain_data_is_not_stored(folder) -> None:
    graph = autopar.capture("tiny-gpt2", seq=16)
    graph.model_config = dict(graph.model_config, pair=(1, 2))  # a tuple reads back a list
    assert not same_graph(graph_from_dict(json.loads(json.dumps(graph_to_dict(graph)))), graph)
    cache.store_graph("k" * 32, graph)
    assert not (folder / f"{'k' * 32}.json.gz").exists()
