"""Hugging Face checkpoints into any plan: every rank reads only its slices, and the sharded
model's logits equal the unsharded Hugging Face model's (fp32, gloo, CPU)."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

import autopar
from autopar.models.source import describe_source
from tests.fixtures.harness import run_ranks
from tests.fixtures.layouts import with_full_size_layout

pytestmark = pytest.mark.dist
SEQ, BATCH = 32, 4


def _ids(vocab: int, rows: int) -> torch.Tensor:
    return torch.randint(0, vocab, (rows, SEQ), generator=torch.Generator().manual_seed(7))


def _logits_probe(trainer, rows: int) -> dict:
    """On every rank: the model's logits for a fixed batch, and what this rank read."""
    out = trainer.logits(_ids(trainer.vocab, rows))
    return dict(logits=out.numpy().copy(), read=trainer.weights.bytes_read,
                local=trainer.init_report.local_bytes)


def _hf_logits(folder, rows: int) -> np.ndarray:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        return model(_ids(model.config.vocab_size, rows)).logits.numpy()


CASES = {"tp2": dict(tp=2), "pp2": dict(pp=2, num_microbatches=2, microbatch_size=2),
         "dp2 zero3": dict(dp=2, zero_stage=3), "ep2": dict(ep=2, zero_stage=0),
         # fully_shard over tensor-parallel shards: FSDP's _StridedShard placements
         "tp2 x dp2 zero3": dict(tp=2, dp=2, zero_stage=3)}
MODELS = {"tiny-llama": ["tp2", "pp2", "dp2 zero3", "tp2 x dp2 zero3"],
          "tiny-gpt2": ["tp2", "pp2", "dp2 zero3"],
          "tiny-qwen2-moe": ["tp2", "pp2", "dp2 zero3", "ep2"]}


def _plan(name: str, pins: dict):
    pins = dict(dict(pp=1, tp=1, dp=1, ep=1, precision="fp32"), **pins)
    if pins["tp"] > 1:
        pins["sequence_parallel"] = False
    graph = autopar.capture(name, seq=SEQ)
    devices = pins["pp"] * pins["tp"] * pins["dp"] * pins["ep"]
    plan = autopar.plan(graph, devices=devices, global_batch=BATCH, constraints=pins)
    if pins["tp"] > 1:  # the layout the planner picks for the full-size sibling
        plan = with_full_size_layout(plan, name)
    return plan


@pytest.mark.parametrize("name,case", [(n, c) for n, cases in MODELS.items() for c in cases])
def test_sharded_loading_gives_the_unsharded_logits(hf_folder, name: str, case: str) -> None:
    folder = hf_folder(name)
    plan = _plan(name, CASES[case])
    rows = plan.num_microbatches * plan.microbatch_size if plan.mesh["pp"] > 1 else BATCH
    *_, got = run_ranks(describe_source(name), plan, 0, init_from=str(folder),
                        probe=functools.partial(_logits_probe, rows=rows))
    expected = _hf_logits(folder, rows)
    np.testing.assert_allclose(got["logits"], expected, atol=1e-5, rtol=0)
    # rank 0 read its slices, not the model: at most its own bytes (+ replicated norms)
    total = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    assert got["read"] <= got["local"] + 1024
    if case != "dp2 zero3" or name != "tiny-gpt2":
        assert got["read"] < total


def test_a_shard_is_read_in_bounded_chunks_in_any_row_order(hf_folder, monkeypatch) -> None:
    """A fused projection's per-part row order and a stacked expert tensor, read a few rows
    at a time (the chunking that bounds a large tensor's transient copy), equal the file."""
    from safetensors import safe_open

    import autopar.weights.hf_weights as hf_weights
    from autopar.models.hf import build_model

    monkeypatch.setattr(hf_weights, "CHUNK_BYTES", 1000)
    for name, fqn, key in (
            ("tiny-phi3", "model.layers.1.self_attn.qkv_proj.weight", None),
            ("tiny-qwen2-moe", "model.layers.0.mlp.experts.gate_up_proj",
             "model.layers.0.mlp.experts.{e}.{part}_proj.weight")):
        folder = hf_folder(name)
        model = build_model(name, device="meta")
        checkpoint = hf_weights.HFCheckpoint(folder, model)
        shape = dict(model.named_parameters())[fqn].shape
        with safe_open(str(folder / "model.safetensors"), "pt") as f:
            whole = f.get_tensor(fqn) if key is None else torch.stack([torch.cat(
                [f.get_tensor(key.format(e=e, part=p)) for p in ("gate", "up")])
                for e in range(shape[0])])
        dim = 0 if key is None else 1
        order = torch.randperm(shape[dim], generator=torch.Generator().manual_seed(0))
        target = torch.empty(shape)
        before = checkpoint.bytes_read
        checkpoint.fill(target, fqn, (dim, order))
        assert torch.equal(target, whole.index_select(dim, order)), name
        assert checkpoint.bytes_read - before == whole.numel() * 4


def test_dtypes_are_converted_and_sharded_folders_read(tmp_path) -> None:
    """A bf16 checkpoint in shards with its index fills an fp32 model with the upcast values."""
    import json

    from safetensors.torch import save_file

    import autopar.weights.hf_weights as hf_weights
    from autopar.models.hf import build_model

    torch.manual_seed(0)
    state = {k: v.to(torch.bfloat16) for k, v in
             build_model("tiny-llama", device="cpu", dtype=torch.float32).state_dict().items()}
    names = sorted(state)
    half = len(names) // 2
    weight_map = {}
    for i, group in enumerate((names[:half], names[half:])):
        file = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({k: state[k] for k in group}, str(tmp_path / file))
        weight_map.update(dict.fromkeys(group, file))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map":
                                                                          weight_map}))
    model = build_model("tiny-llama", device="meta")
    checkpoint = hf_weights.HFCheckpoint(tmp_path, model)
    for fqn in ("model.embed_tokens.weight", names[-1]):
        target = torch.empty(state[fqn].shape, dtype=torch.float32)
        checkpoint.fill(target, fqn)
        assert torch.equal(target, state[fqn].float()), fqn
    (tmp_path / weight_map[names[0]]).unlink()  # an index naming a missing shard
    with pytest.raises(autopar.PlanError, match="copy the whole checkpoint folder"):
        hf_weights.HFCheckpoint(tmp_path, model)
