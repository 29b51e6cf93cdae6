"""An export names where the run's weights started (the ``--init-from`` folder, recorded in
each checkpoint at run time) and carries that folder's tokenizer files."""

from __future__ import annotations

import json
import shutil

import pytest

from autopar.train.checkpoint import latest_checkpoint

from ..cli.test_inspect import cli_here

pytestmark = pytest.mark.dist

TOKENIZER_NAMES = {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"}


@pytest.fixture
def base_folder(hf_folder, tmp_path):
    """tiny-llama's saved weights beside a small tokenizer (save_pretrained's files) and a
    chat template, as a downloaded model folder holds them."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    folder = tmp_path / "base"
    shutil.copytree(hf_folder("tiny-llama"), folder)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["hello world", "the base model"], trainers.BpeTrainer(
        vocab_size=60, special_tokens=["<unk>", "</s>"]))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>",
                            unk_token="<unk>").save_pretrained(folder)
    (folder / "chat_template.jinja").write_text("{{ messages }}")
    assert TOKENIZER_NAMES <= {p.name for p in folder.iterdir()}
    return folder


def _compile(out, *extra: str) -> None:
    done = cli_here("compile", "tiny-llama", "--devices", "1", "--global-batch", "2",
                    "--seq", "16", "--cluster", "cpu", "--out", str(out), "-q", *extra)
    assert done.returncode == 0, done.stderr


def _meta(art) -> dict:
    return json.loads((latest_checkpoint(art / "checkpoints") / "meta.json").read_text())


def test_a_whole_model_export_gets_the_base_tokenizer(base_folder, tmp_path) -> None:
    from transformers import AutoTokenizer

    art = tmp_path / "art"
    _compile(art)
    # a relative --init-from: the checkpoint records it absolute
    run = cli_here("run", str(art), "--steps", "1", "--device", "cpu", "--init-from", "base",
                   cwd=str(tmp_path))
    assert run.returncode == 0, run.stderr
    assert _meta(art)["init_from"] == str(base_folder.resolve())
    # a resumed run (no --init-from) still started from there
    run = cli_here("run", str(art), "--steps", "2", "--device", "cpu", "--resume")  # to 3
    assert run.returncode == 0, run.stderr
    assert _meta(art)["step"] == 3 and _meta(art)["init_from"] == str(base_folder.resolve())
    out = tmp_path / "hf"
    done = cli_here("export", str(art), "--to", "hf", str(out))
    assert done.returncode == 0, done.stderr
    assert f"base model (the run's --init-from): {base_folder.resolve()}" in done.stdout
    for name in TOKENIZER_NAMES:
        assert (out / name).read_bytes() == (base_folder / name).read_bytes(), name
    assert AutoTokenizer.from_pretrained(out, local_files_only=True).eos_token == "</s>"


def test_an_adapter_names_its_base_model(base_folder, tmp_path) -> None:
    from autopar.models.hf import build_model
    from autopar.peft.saved import load_adapter

    art = tmp_path / "lora"
    _compile(art, "--task", "finetune", "--peft", "method=lora,r=2")
    run = cli_here("run", str(art), "--steps", "1", "--device", "cpu", "--init-from",
                   str(base_folder))
    assert run.returncode == 0, run.stderr
    out = tmp_path / "adapter"
    done = cli_here("export", str(art), "--to", "hf", str(out))
    assert done.returncode == 0, done.stderr
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(base_folder.resolve())
    assert TOKENIZER_NAMES <= {p.name for p in out.iterdir()}
    assert load_adapter(build_model("tiny-llama", device="cpu"), out).method == "lora"


def test_a_run_from_random_weights_records_no_base(tmp_path) -> None:
    art = tmp_path / "art"
    _compile(art)
    assert cli_here("run", str(art), "--steps", "1", "--device", "cpu").returncode == 0
    assert _meta(art)["init_from"] is None
    out = tmp_path / "hf"
    done = cli_here("export", str(art), "--to", "hf", str(out))
    assert done.returncode == 0, done.stderr
    assert "base model" not in done.stdout
    assert not {p.name for p in out.iterdir()} & TOKENIZER_NAMES
