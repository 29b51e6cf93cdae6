"""ONNX export of cached generation: onnxruntime's prefill and 20 decode steps, fed their own
cache outputs, equal torch (Hugging Face's static cache, and the same programs run eagerly)
within 1e-4, and its greedy tokens equal autopar.Generator's, for tiny Llama (exported on the
command line from its shipped name) and tiny GPT-2 (from a Hugging Face folder); plans whose
ranks exchange activations inside a token are refused in one line."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import autopar
from autopar.serve.generate import load_model
from autopar.serve.onnx_decode import Decode, OnnxGenerator, Prefill, export_onnx

from ..cli.test_inspect import _assert_one_line_error, cli_here

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12], [20, 21, 22], [30, 31, 32, 33, 34]]
BATCH, PROMPT_LEN, MAX_LEN, STEPS = 3, 8, 32, 20
SIZES = ("--batch", str(BATCH), "--prompt-len", str(PROMPT_LEN), "--max-len", str(MAX_LEN))


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-gpt2"])
def exported(request, hf_folder, tmp_path_factory):
    """(folder written, the torch model it came from, the CLI's result or None)."""
    out = tmp_path_factory.mktemp("onnx") / request.param
    if request.param == "tiny-llama":  # a shipped name: seed-0 weights, as autopar run starts
        result = cli_here("export", "tiny-llama", "--to", "onnx", str(out), *SIZES)
        assert result.returncode == 0, result.stderr
        return out, load_model("tiny-llama", torch.device("cpu")).eval(), result
    folder = hf_folder(request.param)
    # without the graph optimizer (the command line runs it): seconds saved, the same numbers
    export_onnx(str(folder), out, batch=BATCH, prompt_len=PROMPT_LEN, max_len=MAX_LEN,
                optimize=False)
    return out, load_model(str(folder), torch.device("cpu")).eval(), None


def _prompt_batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.zeros(BATCH, PROMPT_LEN, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(PROMPTS):
        ids[row, PROMPT_LEN - len(prompt):] = torch.tensor(prompt)
        mask[row, PROMPT_LEN - len(prompt):] = 1
    return ids, mask


def _diff(onnx_out, torch_out) -> float:
    return max(float((torch.from_numpy(o) - t).abs().max()) for o, t in zip(
        onnx_out, torch_out, strict=True))


def _hf_diff(logits, cache, hf_logits, static, real: torch.Tensor) -> float:
    """Against transformers' StaticCache: the logits, and every slot a real token reads (a
    padding slot holds what no real token sees, computed under a different but unread mask)."""
    worst = float((torch.from_numpy(logits) - hf_logits).abs().max())
    hf = [t for layer in static.layers for t in (layer.keys, layer.values)]
    for ours, theirs in zip(cache, hf, strict=True):
        gap = (torch.from_numpy(ours) - theirs).abs() * real[:, None, :, None]
        worst = max(worst, float(gap.max()))
    return worst


def test_prefill_and_20_decode_steps_equal_torch(exported) -> None:
    from transformers import StaticCache

    out, model, _ = exported
    onnx = OnnxGenerator(out)
    ids, mask = _prompt_batch()
    prefill, decode = Prefill(model), Decode(model)
    static = StaticCache(config=model.config, max_cache_len=MAX_LEN)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        eager = prefill(ids, mask, *[torch.from_numpy(t) for t in onnx.empty_cache()])
        hf_logits = model(input_ids=ids, attention_mask=mask, position_ids=positions,
                          cache=static, use_cache=True).logits[:, -1]
    logits, cache = onnx.prefill(ids.numpy(), mask.numpy())
    keys = torch.zeros(BATCH, MAX_LEN, dtype=torch.long)
    keys[:, :PROMPT_LEN] = mask
    worst = _diff([logits, *cache], eager)
    worst_hf = _hf_diff(logits, cache, hf_logits, static, keys)
    position = positions[:, -1:]
    for step in range(STEPS):
        token = torch.from_numpy(logits).argmax(-1)[:, None]
        slot = PROMPT_LEN + step
        keys[:, slot] = 1
        position = position + 1
        with torch.no_grad():
            eager = decode(token, keys, position, torch.tensor([slot]), *eager[1:])
            hf_logits = model(input_ids=token, attention_mask=keys[:, :slot + 1],
                              position_ids=position, cache=static, use_cache=True).logits[:, -1]
        # onnxruntime carries its own cache from step to step, never torch's
        logits, cache = onnx.decode(token.numpy(), keys.numpy(), position.numpy(),
                                    np.array([slot]), cache)
        worst = max(worst, _diff([logits, *cache], eager))
        worst_hf = max(worst_hf, _hf_diff(logits, cache, hf_logits, static, keys))
    print(f"{out.name}: max abs diff over prefill + {STEPS} decode steps: {worst:.2e} against "
          f"the eager programs (whole cache), {worst_hf:.2e} against StaticCache")
    assert worst < 1e-4 and worst_hf < 1e-4


def test_greedy_tokens_equal_the_generator(exported) -> None:
    out, model, _ = exported
    onnx, ours = OnnxGenerator(out), autopar.Generator(model)
    expected = ours.generate(PROMPTS, max_new_tokens=STEPS + 1)
    assert torch.equal(onnx.generate(PROMPTS, max_new_tokens=STEPS + 1), expected)
    width = max(len(p) for p in PROMPTS)
    eos = int(expected[1, width + 3])  # a stop token: finished rows continue with the pad id
    assert torch.equal(onnx.generate(PROMPTS, max_new_tokens=STEPS, eos_token_id=eos,
                                     pad_token_id=0),
                       ours.generate(PROMPTS, max_new_tokens=STEPS, eos_token_id=eos,
                                     pad_token_id=0))
    # fewer prompts than the export's batch: the spare rows run a dummy prompt
    assert torch.equal(onnx.generate(PROMPTS[1:], max_new_tokens=5),
                       ours.generate(PROMPTS[1:], max_new_tokens=5))
    with pytest.raises(autopar.PlanError, match="max_new_tokens must be 1..25"):
        onnx.generate(PROMPTS, max_new_tokens=26)
    with pytest.raises(autopar.PlanError, match="prompts of 1..8 tokens"):
        onnx.generate([list(range(9))])


@pytest.mark.parametrize("exported", ["tiny-llama"], indirect=True)
def test_the_command_writes_both_programs(exported) -> None:
    out, _, result = exported
    assert "prefill.onnx and decode.onnx" in result.stdout
    assert sorted(p.name for p in out.iterdir()) == ["decode.onnx", "generation.json",
                                                     "prefill.onnx"]
    assert not out.with_name(out.name + ".partial").exists()
    spec = json.loads((out / "generation.json").read_text())
    assert spec["decode"]["inputs"][:4] == ["input_ids", "attention_mask", "position_ids",
                                           "cache_position"]
    assert spec["decode"]["outputs"][:3] == ["logits", "present.0.key", "present.0.value"]
    import onnxruntime as ort

    session = ort.InferenceSession(str(out / "decode.onnx"), providers=["CPUExecutionProvider"])
    shapes = {i.name: i.shape for i in session.get_inputs()}
    assert shapes["input_ids"] == [BATCH, 1] and shapes["attention_mask"] == [BATCH, MAX_LEN]
    assert shapes["past_key_values.3.value"] == [BATCH, 2, MAX_LEN, 16]  # 2 kv heads of 16
    assert len(shapes) == 4 + 2 * 4


def test_bad_inputs_are_refused_in_one_line(tmp_path, monkeypatch) -> None:
    out = tmp_path / "onnx"
    _assert_one_line_error(cli_here("export", str(tmp_path / "missing"), "--to", "onnx",
                                    str(out)), "no model config", "not a shipped name")
    _assert_one_line_error(cli_here("export", "tiny-llama", "--to", "onnx", str(out),
                                    "--max-len", "1000"), "exceeds the model's 256 positions")
    _assert_one_line_error(cli_here("export", "tiny-llama", "--to", "onnx", str(out),
                                    "--prompt-len", "16", "--max-len", "16"), "max_len >")
    _assert_one_line_error(cli_here("export", "tiny-llama", "--to", "onnx", str(out),
                                    "--merge"), "--merge is for --to hf")
    _assert_one_line_error(cli_here("export", "tiny-llama", "--to", "hf", str(out),
                                    "--batch", "2"), "--batch is for --to onnx")
    # nothing half-written when the exporter fails
    monkeypatch.setattr(torch.onnx, "export", _broken)
    with pytest.raises(RuntimeError, match="exporter broke"):
        export_onnx("tiny-llama", out, max_len=16, prompt_len=4)
    assert not out.exists() and not out.with_name("onnx.partial").exists()
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    _assert_one_line_error(cli_here("export", "tiny-llama", "--to", "onnx", str(out)),
                           "already exists")
    # a tensor-parallel plan: its ranks all-reduce inside every layer
    art = tmp_path / "tp2"
    assert cli_here("compile", "tiny-llama", "--devices", "2", "--global-batch", "2", "--seq",
                    "16", "--constraints", "tp=2", "--cluster", "cpu", "--out", str(art),
                    "-q").returncode == 0
    _assert_one_line_error(cli_here("export", str(art), "--to", "onnx", str(tmp_path / "o")),
                           "tp=2", "all-reduce inside every layer", "--to hf")
    assert not (tmp_path / "o").exists()


def _broken(*args, **kwargs):
    raise RuntimeError("exporter broke")
