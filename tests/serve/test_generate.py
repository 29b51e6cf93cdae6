"""Cached generation: the same greedy tokens as Hugging Face's generate (tiny Llama, GPT-2,
Mixtral and DeepSeek-V2 from config, the last from its compressed latent cache; a batch of
prompts of different lengths, stop tokens), in one process and under tp2 on gloo; seeded
sampling with Hugging Face's warpers; an artifact generates with its trained weights."""

from __future__ import annotations

import pytest
import torch

import autopar
from autopar.models.hf import build_model
from autopar.serve.generate import left_pad, sample_next
from tests.fixtures.harness import run_in_group, spawn_ranks
from tests.fixtures.layouts import with_full_size_layout

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12], [20, 21, 22], [30, 31, 32, 33, 34]]
NEW = 20


def _model(name: str):
    torch.manual_seed(0)
    return build_model(name, device="cpu", dtype=torch.float32).eval()


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2", "tiny-mixtral"])
def test_greedy_tokens_equal_hugging_face(name: str) -> None:
    model = _model(name)
    ours = autopar.Generator(model).generate(PROMPTS, max_new_tokens=NEW)
    ids, mask = left_pad(PROMPTS, 0)
    theirs = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                            use_cache=True, pad_token_id=0)
    assert torch.equal(ours, theirs)
    # a stop token: finished rows continue with the pad id, as in Hugging Face
    eos = int(ours[1, ids.shape[1] + 3])
    ours = autopar.Generator(model).generate(ids, mask, max_new_tokens=NEW, eos_token_id=eos,
                                             pad_token_id=0)
    theirs = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                            use_cache=True, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(ours, theirs) and (ours[1, ids.shape[1] + 4:] == 0).all()


def test_latent_attention_generates_from_its_compressed_cache() -> None:
    """Tiny DeepSeek-V2 (MLA): the greedy tokens of Hugging Face's generate, and the cache
    generation keeps holds each layer's latent and shared rotary key (one "head" of
    kv_lora_rank and qk_rope_head_dim), not every head's keys and values."""
    from autopar.ir.latent import decompressed_cache_width, latent_cache_width
    from autopar.serve.generate import new_cache

    model = _model("tiny-deepseek-v2")
    ours = autopar.Generator(model).generate(PROMPTS, max_new_tokens=NEW)
    ids, mask = left_pad(PROMPTS, 0)
    theirs = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                            use_cache=True, pad_token_id=0)
    assert torch.equal(ours, theirs)
    config = model.config
    cache = new_cache(config, ids.shape[1] + NEW)
    with torch.no_grad():
        model(ids, attention_mask=mask, cache=cache, use_cache=True)
    width = latent_cache_width(config.to_dict())
    assert width == config.kv_lora_rank + config.qk_rope_head_dim
    held = 0
    for layer in cache.layers:
        assert layer.keys.shape == (len(PROMPTS), 1, ids.shape[1] + NEW, config.kv_lora_rank)
        assert layer.values.shape[1:] == (1, ids.shape[1] + NEW, config.qk_rope_head_dim)
        held += layer.keys.nbytes + layer.values.nbytes
    positions = len(PROMPTS) * (ids.shape[1] + NEW) * config.num_hidden_layers
    assert held == positions * width * 4
    # every head's keys (nope + rope) and values: 4 x (16 + 8 + 16) = 160 per token, 4x more
    assert decompressed_cache_width(config.to_dict()) == 4 * width


def test_sampling_uses_hugging_faces_warpers() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    warped = TopPLogitsWarper(0.8)(None, TopKLogitsWarper(10)(None, TemperatureLogitsWarper(
        0.7)(None, logits.clone())))
    allowed = torch.isfinite(warped)
    for seed in range(20):
        token = sample_next(logits, 0.7, 10, 0.8, torch.Generator().manual_seed(seed))
        assert allowed[torch.arange(4), token].all()
    model = _model("tiny-llama")
    generator = autopar.Generator(model)
    greedy = generator.generate(PROMPTS, max_new_tokens=8)
    assert torch.equal(generator.generate(PROMPTS, max_new_tokens=8, do_sample=True, top_k=1),
                       greedy)
    a = generator.generate(PROMPTS, max_new_tokens=8, do_sample=True, temperature=1.5, seed=3)
    b = generator.generate(PROMPTS, max_new_tokens=8, do_sample=True, temperature=1.5, seed=3)
    assert torch.equal(a, b) and not torch.equal(a, greedy)


def _generate_under(plan_dict: dict, name: str = "tiny-llama") -> list:
    from autopar.plan import Plan

    tokens = autopar.Generator(_model(name), Plan.from_dict(plan_dict)).generate(
        PROMPTS, max_new_tokens=NEW)
    return tokens.tolist()


def _rank(rank: int, port: int, out, world: int, plan_dict: dict, name: str = "tiny-llama"
          ) -> None:
    run_in_group(rank, port, out, world, _generate_under, plan_dict, name)


# plans from the search: tensor parallelism (the planner's full-size layout: attention split
# by heads, so is the cache), pipeline stages (each caches its own layers; interleaved chunks
# hand the hidden states on several times per token), and both
PLANS = {"tp2": dict(tp=2, pp=1), "pp2": dict(pp=2, tp=1, schedule="1f1b"),
         "pp2 interleaved": dict(pp=2, tp=1, schedule="interleaved", virtual_stages=2),
         "pp2 x tp2": dict(pp=2, tp=2, schedule="1f1b")}


@pytest.mark.dist
@pytest.mark.parametrize("case", list(PLANS))
def test_parallel_generation_gives_one_process_tokens(case: str) -> None:
    pins = PLANS[case]
    devices = pins["pp"] * pins["tp"]
    graph = autopar.capture("tiny-llama", seq=32)
    plan = autopar.plan(graph, devices=devices, global_batch=4, constraints=dict(
        pins, dp=1, sequence_parallel=False, precision="fp32"))
    if pins["tp"] > 1:
        plan = with_full_size_layout(plan, "tiny-llama")
        assert plan.placements["params"]["model.layers.0.self_attn.k_proj.weight"] == \
            "Shard(0)@tp"
    expected = autopar.Generator(_model("tiny-llama")).generate(PROMPTS, max_new_tokens=NEW)
    (tokens,) = spawn_ranks(_rank, devices, (devices, plan.to_dict()), timeout_s=180)
    assert tokens == expected.tolist()


@pytest.mark.dist
def test_latent_attention_split_by_heads_gives_one_process_tokens() -> None:
    """Tiny DeepSeek-V2 under tp2 with the layout the planner chooses for DeepSeek-V2-Lite
    (MLA's q and kv_b split by heads, the latent down-projection whole): each rank caches the
    whole latent and expands it to its own heads; the tokens are one process's."""
    graph = autopar.capture("tiny-deepseek-v2", seq=32)
    plan = autopar.plan(graph, devices=2, global_batch=4, constraints=dict(
        tp=2, pp=1, dp=1, ep=1, sequence_parallel=False, precision="fp32"))
    plan = with_full_size_layout(plan, "tiny-deepseek-v2")
    assert plan.placements["params"]["model.layers.1.self_attn.kv_b_proj.weight"] == \
        "Shard(0)@tp"
    expected = autopar.Generator(_model("tiny-deepseek-v2")).generate(PROMPTS,
                                                                       max_new_tokens=NEW)
    (tokens,) = spawn_ranks(_rank, 2, (2, plan.to_dict(), "tiny-deepseek-v2"), timeout_s=180)
    assert tokens == expected.tolist()


def test_an_artifact_generates_with_its_trained_weights(tmp_path, hf_folder) -> None:
    from transformers import AutoModelForCausalLM

    from ..cli.test_inspect import cli_here

    art, out = tmp_path / "art", tmp_path / "hf"
    for args in (("compile", "tiny-llama", "--devices", "1", "--global-batch", "2", "--seq",
                  "16", "--cluster", "cpu", "--out", str(art), "-q"),
                 ("run", str(art), "--steps", "2", "--device", "cpu", "--lr", "0.01",
                  "--init-from", str(hf_folder("tiny-llama"))),
                 ("export", str(art), "--to", "hf", str(out))):
        assert cli_here(*args).returncode == 0
    trained = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids, mask = left_pad(PROMPTS, 0)
    expected = trained.generate(ids, attention_mask=mask, max_new_tokens=NEW,
                                do_sample=False, use_cache=True, pad_token_id=0)
    assert torch.equal(autopar.Generator(art).generate(PROMPTS, max_new_tokens=NEW), expected)
    with pytest.raises(autopar.PlanError, match="max_new_tokens"):
        autopar.Generator(art).generate(PROMPTS, max_new_tokens=0)
    with pytest.raises(autopar.PlanError, match="no complete checkpoint"):
        cli_here("compile", "tiny-llama", "--devices", "1", "--global-batch", "2", "--seq",
                 "16", "--out", str(tmp_path / "fresh"), "-q")
        autopar.Generator(tmp_path / "fresh")


def test_a_prefix_tuned_model_generates_what_it_trains_on() -> None:
    """Cached decoding of a Prefix-Tuning model (its positions after the prefix, the prefix
    before the cached keys) gives the tokens of recomputing the whole sequence each step."""
    from autopar.peft import apply_peft

    model = _model("tiny-llama")
    apply_peft(model, "method=prefix_tuning,num_virtual_tokens=4")
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    cached = autopar.Generator(model).generate(ids, max_new_tokens=10)
    with torch.no_grad():
        for _ in range(10):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(cached, ids)


def test_generate_on_the_command_line(tmp_path) -> None:
    import json

    from ..cli.test_inspect import _assert_one_line_error, cli_here, run_cli

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"ids": p}) + "\n" for p in PROMPTS))
    result = run_cli("generate", "tiny-llama", "--prompts", str(prompts), "--max-new-tokens",
                     "6")
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line)["new_ids"] for line in result.stdout.splitlines()]
    expected = autopar.Generator("tiny-llama").generate(PROMPTS, max_new_tokens=6)
    assert rows == expected[:, -6:].tolist()
    assert "tokens/s" in result.stderr
    text = tmp_path / "q.txt"
    text.write_text("hello\n")
    _assert_one_line_error(cli_here("generate", "tiny-llama", "--prompts", str(text)),
                           "needs a tokenizer", "--tokenizer")
    _assert_one_line_error(cli_here("generate", "tiny-llama", "--prompts",
                                    str(tmp_path / "none.jsonl")), "no such file")
    _assert_one_line_error(cli_here("generate", "tiny-llama", "--prompts", str(prompts),
                                    "--max-new-tokens", "0"), "max_new_tokens")
