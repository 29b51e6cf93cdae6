"""Export back to Hugging Face: a run's latest distributed checkpoint becomes a folder that
from_pretrained loads, under the names save_pretrained writes; bad inputs are refused."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from safetensors import safe_open

import autopar
from autopar.models.source import describe_source
from tests.fixtures.harness import run_ranks
from tests.fixtures.layouts import with_full_size_layout
from tests.weights.test_hf_weights import _ids, _logits_probe

from ..cli.test_inspect import _assert_one_line_error, cli_here, run_cli
from ..cli.test_run import FIXTURES

pytestmark = pytest.mark.dist


def _keys(folder) -> set[str]:
    keys = set()
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            keys |= set(f.keys())
    return keys


def _compile(name: str, out, devices: int) -> None:
    result = cli_here("compile", name, "--devices", str(devices), "--global-batch", "4",
                      "--seq", "32", "--cluster", "cpu", "--out", str(out), "-q")
    assert result.returncode == 0, result.stderr


def test_round_trip_through_training_keeps_the_logits(hf_folder, tmp_path) -> None:
    """HF weights in, 3 steps under tp2 x dp2 (the planner's full-size layout), export, and
    from_pretrained gives autopar's final logits."""
    from transformers import AutoModelForCausalLM

    art = tmp_path / "art"
    _compile("tiny-llama", art, 4)
    graph = autopar.capture("tiny-llama", seq=32)
    plan = autopar.plan(graph, devices=4, global_batch=4, cluster="cpu", constraints=dict(
        tp=2, dp=2, pp=1, zero_stage=2, sequence_parallel=False, precision="fp32"))
    plan = with_full_size_layout(plan, "tiny-llama")
    losses, sharded, final = run_ranks(
        describe_source("tiny-llama"), plan, 3, checkpoint_dir=str(art / "checkpoints"),
        init_from=str(hf_folder("tiny-llama")), probe=functools.partial(_logits_probe, rows=4))
    assert sharded > 0 and losses[0] != losses[-1]
    out = tmp_path / "hf"
    result = run_cli("export", str(art), "--to", "hf", str(out))
    assert result.returncode == 0, result.stderr
    assert "exported step 3" in result.stdout
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        logits = model(_ids(model.config.vocab_size, 4)).logits.numpy()
    np.testing.assert_allclose(logits, final["logits"], atol=1e-5, rtol=0)
    assert _keys(out) == _keys(hf_folder("tiny-llama"))  # the names it was loaded from


@pytest.mark.parametrize("name", ["tiny-qwen2-moe", "tiny-gpt2", "tiny-phi3"])
def test_export_writes_what_save_pretrained_writes(hf_folder, tmp_path, name: str) -> None:
    """Per-expert tensors for stacked experts, no tied copy, fused projections in the
    model's own order: the export of the loaded weights (one step at lr 0) equals the
    folder they came from, tensor for tensor, and is sharded with an index when asked."""
    art = tmp_path / "art"
    _compile(name, art, 1)
    source = hf_folder(name)
    run = cli_here("run", str(art), "--steps", "1", "--lr", "0", "--device", "cpu",
                   "--init-from", str(source))
    assert run.returncode == 0, run.stderr
    out = tmp_path / "hf"
    result = cli_here("export", str(art), "--to", "hf", str(out), "--max-shard-size", "300KB")
    assert result.returncode == 0, result.stderr
    assert (out / "model.safetensors.index.json").is_file() and (out / "config.json").is_file()
    assert len(list(out.glob("*.safetensors"))) > 1
    assert _keys(out) == _keys(source)
    for file in source.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            theirs = {k: f.get_tensor(k) for k in f.keys()}
    ours = {}
    for file in out.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            ours.update({k: f.get_tensor(k) for k in f.keys()})
    for key, value in theirs.items():
        assert torch.equal(ours[key], value), key


def test_bad_inputs_are_refused_in_one_line(hf_folder, tmp_path) -> None:
    art = tmp_path / "art"
    _compile("tiny-llama", art, 1)
    out = tmp_path / "hf"
    # no checkpoint yet
    _assert_one_line_error(run_cli("export", str(art), "--to", "hf", str(out)),
                           "no complete checkpoint", "autopar run")
    assert not out.exists()
    # a checkpoint of another model: names and shapes differ, refused before any allocation
    _assert_one_line_error(cli_here("run", str(art), "--steps", "1", "--device", "cpu",
                                   "--init-from", str(hf_folder("tiny-gpt2"))),
                           "does not match the model", "this model's config")
    assert not (art / "logs").exists() and not (art / "checkpoints").exists()
    from autopar.models.hf import build_model, load_config

    wider = tmp_path / "wider"  # the same names, other shapes
    build_model(dict(load_config("tiny-llama"), intermediate_size=128),
                device="cpu").save_pretrained(wider)
    _assert_one_line_error(cli_here("run", str(art), "--steps", "1", "--device", "cpu",
                                   "--init-from", str(wider)),
                           "there but [64, 176] in the model", "this model's config")
    # a torch .bin checkpoint
    other = tmp_path / "bin"
    other.mkdir()
    (other / "config.json").write_text("{}")
    torch.save({}, other / "pytorch_model.bin")
    _assert_one_line_error(cli_here("run", str(art), "--steps", "1", "--device", "cpu",
                                   "--init-from", str(other)), ".bin", "safetensors")
    # an existing, non-empty output folder is never overwritten
    assert cli_here("run", str(art), "--steps", "1", "--device", "cpu", "--init-from",
                   str(hf_folder("tiny-llama"))).returncode == 0
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    _assert_one_line_error(cli_here("export", str(art), "--to", "hf", str(out)),
                           "already exists")
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    # a model that is not a transformers one has no Hugging Face form
    plain = tmp_path / "plain"
    assert cli_here("compile", "plain_lm:make", "--devices", "1", "--global-batch", "4",
                   "--out", str(plain), "-q", cwd=FIXTURES).returncode == 0
    assert cli_here("run", str(plain), "--steps", "1", "--device", "cpu",
                   cwd=FIXTURES).returncode == 0
    _assert_one_line_error(cli_here("export", str(plain), "--to", "hf", str(tmp_path / "x"),
                                   cwd=FIXTURES), "factory model", "transformers config")
