"""Capture through torch.export (and its fx fallback) into the IR."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autopar
from autopar.capture import torch_capture
from autopar.ir import OpKind
from autopar.models import GPT, GPTConfig, build_model, list_models, token_inputs

from ..conftest import TINY_HF


@pytest.mark.parametrize("name", [n for n in list_models() if n.startswith("tiny-")])
def test_param_count_equals_model(name: str) -> None:
    """(Full-size configs: tests/models/test_shipped_configs.py, from its own capture.)"""
    model = build_model(name, device="meta")
    graph = autopar.capture(model, token_inputs(1, 16))
    assert graph.num_params == sum(p.numel() for p in model.parameters())
    assert graph.source == "torch.export"


def _gpt_flops(layers: int, hidden: int, ffn: int, vocab: int, batch: int, seq: int) -> int:
    """2 x matmul parameters x tokens + attention (4*b*s^2*h per layer), from the config alone."""
    matmul_params = layers * (3 * hidden * hidden + hidden * hidden + 2 * hidden * ffn)
    matmul_params += hidden * vocab  # LM head
    tokens = batch * seq
    return 2 * matmul_params * tokens + layers * 4 * batch * seq * seq * hidden


def test_gpt2_forward_flops_match_formula() -> None:
    graph = autopar.capture("gpt2", batch=2, seq=1024)
    expected = _gpt_flops(12, 768, 3072, 50257, 2, 1024)
    assert graph.flops == pytest.approx(expected, rel=0.01)
    assert graph.tokens == 2048


def test_plain_gpt_forward_flops_match_formula() -> None:
    cfg = GPTConfig(vocab_size=512, seq_len=256, d_model=256, n_layers=3, n_heads=8)
    with torch.device("meta"):
        model = GPT(cfg)
    graph = autopar.capture(model, token_inputs(4, 256))
    expected = _gpt_flops(3, 256, 1024, 512, 4, 256)
    assert graph.flops == pytest.approx(expected, rel=0.01)


@pytest.mark.parametrize("name", TINY_HF)
def test_tiny_hf_models_have_layer_blocks_of_one_type(name: str) -> None:
    graph = autopar.capture(name, seq=32)
    roles = [b.role for b in graph.blocks]
    assert roles == ["head"] + ["layer"] * 4 + ["tail"]
    assert len({b.type_id for b in graph.layer_blocks}) == 1
    assert graph.blocks[0].kind == "embedding"
    assert graph.blocks[-1].kind == "output"
    # every op belongs to exactly one block
    assert sorted(n for b in graph.blocks for n in b.nodes) == sorted(op.name for op in graph.ops)


def test_llama3_8b_blocks() -> None:
    graph = autopar.capture("llama3-8b", seq=128)
    assert len(graph.layer_blocks) == 32
    assert len(graph.blocks) == 34
    assert len({b.type_id for b in graph.layer_blocks}) == 1
    layer = graph.layer_blocks[0]
    assert layer.param_numel == 4096 * (4096 * 2 + 1024 * 2) + 3 * 4096 * 14336 + 2 * 4096
    assert {graph.op(n).kind for n in layer.nodes} >= {OpKind.LINEAR, OpKind.ATTENTION, OpKind.NORM}


def test_mixtral_router_and_experts_are_identified() -> None:
    graph = autopar.capture("tiny-mixtral", seq=32)
    assert all(b.kind == "moe" for b in graph.layer_blocks)
    layer = graph.layer_blocks[0]
    ops = [graph.op(n) for n in layer.nodes]
    router = [op for op in ops if op.kind is OpKind.MOE_ROUTER]
    experts = [op for op in ops if op.kind is OpKind.MOE_EXPERT]
    assert any(op.params == ["model.layers.0.mlp.gate.weight"] for op in router)
    assert any("topk" in op.target for op in router)
    expert_params = {p for op in experts for p in op.params}
    assert expert_params == {"model.layers.0.mlp.experts.gate_up_proj",
                             "model.layers.0.mlp.experts.down_proj"}
    # active expert FLOPs: each of 32 tokens meets top-2 experts, each a gated MLP
    cfg = graph.model_config
    per_token = 2 * 3 * cfg["hidden_size"] * cfg["intermediate_size"] * cfg["num_experts_per_tok"]
    expert_flops = sum(op.flops for op in experts if "grouped_mm" in op.target)
    assert expert_flops == per_token * 32


def test_real_model_with_meta_inputs_and_meta_model_with_real_inputs(tiny_gpt, token_ids) -> None:
    real = autopar.capture(tiny_gpt, (token_ids.to("meta"),))
    with torch.device("meta"):  # .to("meta") would untie the embedding and head
        meta_model = GPT(tiny_gpt.cfg)
    meta = autopar.capture(meta_model, (token_ids,))
    assert real.flops == meta.flops and real.num_params == meta.num_params
    assert all(p.device.type == "cpu" for p in tiny_gpt.parameters())  # model left where it was


def test_tied_embedding_counted_once(tiny_gpt, token_ids) -> None:
    graph = autopar.capture(tiny_gpt, (token_ids,))
    assert "tok_emb.weight" in graph.params
    assert graph.params["tok_emb.weight"].aliases == ("head.weight",)
    users = [op for op in graph.ops if "tok_emb.weight" in op.params]
    assert {op.kind for op in users} == {OpKind.EMBEDDING, OpKind.LINEAR}


def test_symbolic_trace_fallback_when_export_fails(tiny_gpt, token_ids, monkeypatch) -> None:
    exported = autopar.capture(tiny_gpt, (token_ids,))

    def broken_export(*_a, **_k):
        raise RuntimeError("export unavailable")

    monkeypatch.setattr(torch.export, "export", broken_export)
    traced = autopar.capture(tiny_gpt, (token_ids,))
    assert traced.source == "fx.symbolic_trace"
    assert traced.num_params == exported.num_params
    assert traced.flops == pytest.approx(exported.flops, rel=0.01)
    assert [b.role for b in traced.blocks] == [b.role for b in exported.blocks]


class _DataDependent(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # needs the values: no tracer can follow this
            return x * 2
        return x


class _Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.gate = _DataDependent()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(self.fc(x))


def test_untraceable_model_names_the_module() -> None:
    with pytest.raises(autopar.CaptureError) as info:
        autopar.capture(_Outer(), (torch.zeros(2, 8),))
    message = str(info.value)
    assert "module 'gate' (_DataDependent)" in message
    assert "fix:" in message and "\n" not in message


def test_wrong_arity_is_reported_before_tracing(tiny_gpt, token_ids) -> None:
    with pytest.raises(autopar.CaptureError, match=r"GPT\.forward\(idx"):
        autopar.capture(tiny_gpt, (token_ids, None, token_ids))
    with pytest.raises(autopar.CaptureError, match="no example inputs"):
        autopar.capture(tiny_gpt)


def test_unknown_model_name_lists_shipped_names() -> None:
    with pytest.raises(autopar.CaptureError, match="tiny-llama"):
        autopar.capture("no-such-model")


def test_corrupt_config_file(tmp_path) -> None:
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(autopar.CaptureError, match="cannot read model config"):
        autopar.capture(str(tmp_path))
    bad.write_text('{"hidden_size": 8}')
    with pytest.raises(autopar.CaptureError, match="model_type"):
        autopar.capture(str(bad))


def test_param_table_records_aliases() -> None:
    with torch.device("meta"):
        model = GPT(GPTConfig(n_layers=1))
    table, canon = torch_capture.param_table(model)
    assert canon["head.weight"] == "tok_emb.weight"
    assert "head.weight" not in table
