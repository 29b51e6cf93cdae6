"""``autopar init|train|finetune|eval|predict`` as a user runs them: init then train as
written, eval and predict on the trained run, fine-tuning, bad inputs refused in one line
with nothing written, and a run config under dp2 x tp2 equal to the same run built from
``autopar data prepare`` + ``autopar compile`` + ``autopar run`` flags."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

import autopar
from autopar.data.dataset import TokenDataset
from autopar.data.sets import TEXT_SETS
from tests.cli.test_inspect import cli_here

ROOT = Path(__file__).resolve().parents[2]
TINY_TOKENIZER = ROOT / "autopar" / "models" / "tokenizers" / "tiny" / "tokenizer.json"


def _autopar(*args: str, cwd: Path, nproc: int = 0) -> subprocess.CompletedProcess:
    """The real command (a new interpreter; under torchrun with ``nproc`` processes)."""
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone",
              "--nproc-per-node", str(nproc)] if nproc else [sys.executable]
    return subprocess.run([*launch, "-m", "autopar", *args], capture_output=True, text=True,
                          timeout=300, cwd=cwd)


def _losses(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "logs" / "train.jsonl").read_text()
            .splitlines()]


def _files(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*")}


def _one_line(result: subprocess.CompletedProcess, *words: str) -> None:
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("autopar: error: "), result.stderr
    for word in words:
        assert word in lines[0], lines[0]


def test_init_then_train_as_written_then_eval_and_predict(tmp_path) -> None:
    start = time.perf_counter()
    made = _autopar("init", cwd=tmp_path)
    assert made.returncode == 0 and "autopar train autopar.yaml" in made.stdout
    trained = _autopar("train", "autopar.yaml", cwd=tmp_path)
    seconds = time.perf_counter() - start
    assert trained.returncode == 0, trained.stderr[-3000:]
    run = tmp_path / "autopar-run"
    records = _losses(run)
    assert len(records) == 30 and records[-1]["loss"] < records[0]["loss"] - 1.0
    assert "trained to step 30" in trained.stdout
    assert (run / "checkpoints" / "latest").is_file()
    print(f"autopar init && autopar train autopar.yaml: {seconds:.1f} s")
    # eval: the trained checkpoint's loss on data.eval, then the shipped scored sets
    scored = cli_here("eval", "autopar.yaml", cwd=str(tmp_path))
    assert scored.returncode == 0, scored.stderr[-3000:]
    metrics = json.loads(scored.stdout.strip().splitlines()[-1])
    assert metrics["weights"].endswith("step_000030")
    last_eval = json.loads((run / "logs" / "eval.jsonl").read_text().splitlines()[-1])
    assert metrics["eval_loss"] == pytest.approx(last_eval["loss"], abs=1e-5)
    assert 0 <= metrics["tiny-choice_accuracy"] <= 1 and metrics["tiny-choice_count"] == 24
    assert 0 <= metrics["tiny-qa_exact_match"] <= 1
    # predict: one JSON line per prompt, from the trained weights
    said = cli_here("predict", "autopar.yaml", "--set", "predict.prompts=[the red cat]",
                    cwd=str(tmp_path))
    assert said.returncode == 0, said.stderr[-3000:]
    lines = [json.loads(line) for line in said.stdout.strip().splitlines()]
    assert [line["prompt"] for line in lines] == ["the red cat"] and lines[0]["text"]
    # a second run is refused unless it resumes (or overwrites); --resume continues it
    again = cli_here("train", "autopar.yaml", cwd=str(tmp_path))
    _one_line(again, "--resume", "training.overwrite_output_dir=true")
    more = cli_here("train", "autopar.yaml", "--resume", "--steps", "32", cwd=str(tmp_path))
    assert more.returncode == 0, more.stderr[-3000:]
    assert [r["step"] for r in _losses(run)][-2:] == [30, 31]
    assert "step 32/32" in more.stdout + more.stderr  # counted from the first run


def test_finetune_needs_adapters_or_weights_and_says_which(tmp_path, hf_folder) -> None:
    config = tmp_path / "ft.yaml"
    config.write_text("model: tiny-llama\ndata: {train: {set: tiny-text}}\n"
                      "training: {output_dir: ft, max_steps: 2, global_batch_size: 4, "
                      "max_seq_length: 32, use_cpu: true, save_strategy: 'no'}\n")
    refused = cli_here("finetune", str(config), cwd=str(tmp_path))
    _one_line(refused, "no weights", "peft", "autopar train")
    assert _files(tmp_path) == {"ft.yaml"}
    lora = cli_here("finetune", str(config), "--set", "peft={method: lora, r: 4}",
                    cwd=str(tmp_path))
    assert lora.returncode == 0, lora.stderr[-3000:]
    assert "fine-tuning adapters" in lora.stderr and "seeded weights" in lora.stderr
    assert autopar.Plan.load(tmp_path / "ft" / "plan.yaml").task == "finetune"
    folder = hf_folder("tiny-llama")
    untokenized = cli_here("finetune", str(config), "--set", f"model={folder}", "--set",
                           "training.output_dir=full", cwd=str(tmp_path))
    _one_line(untokenized, "set tokenizer")
    assert not (tmp_path / "full").exists()
    full = cli_here("finetune", str(config), "--set", f"model={folder}", "--set",
                    "training.output_dir=full", "--set", f"tokenizer={TINY_TOKENIZER.parent}",
                    cwd=str(tmp_path))
    assert full.returncode == 0, full.stderr[-3000:]
    assert "fine-tuning every weight" in full.stderr and len(_losses(tmp_path / "full")) == 2


def test_bad_inputs_exit_2_with_one_line_and_write_nothing(tmp_path) -> None:
    (tmp_path / "rows.jsonl").write_text('{"body": "the cat"}\n')
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine\n")
    good = ("model: tiny-llama\ndata: {train: {set: tiny-text}}\n"
            "training: {output_dir: out, max_steps: 2, use_cpu: true}\n")
    cases = [
        ("train", good.replace("max_steps", "max_step"), [], ["training.max_step",
                                                             "did you mean max_steps?"]),
        ("train", good.replace("max_steps: 2", "max_steps: two"), [], ["training.max_steps",
                                                                       "whole number"]),
        ("train", good, ["--set", "training.fsdp=full_shard"], ["fsdp is not read"]),
        ("train", good, ["--set", "training"], ["SECTION.FIELD=VALUE"]),
        ("train", good, ["--set", "data.train={path: rows.jsonl}"], ["columns are ['body']"]),
        ("train", good, ["--set", "training.output_dir=taken"], ["not an autopar run"]),
        ("train", "model: tiny-llama\n", [], ["no data.train"]),
        ("train", "model: [\n", [], ["not valid YAML"]),
        ("eval", good, [], ["nothing to evaluate"]),
        ("predict", good, [], ["no predict section"]),
        ("finetune", good, [], ["no weights"]),
    ]
    for command, text, extra, words in cases:
        (tmp_path / "run.yaml").write_text(text)
        before = _files(tmp_path)
        _one_line(cli_here(command, "run.yaml", *extra, cwd=str(tmp_path)), *words)
        assert _files(tmp_path) == before, (command, extra)
    _one_line(cli_here("train", "missing.yaml", cwd=str(tmp_path)), "autopar init")
    assert cli_here("train", "run.yaml", "--steps", "0", cwd=str(tmp_path)).returncode == 2
    # init: never over a file unless --force, never into a missing folder
    _one_line(cli_here("init", "run.yaml", cwd=str(tmp_path)), "--force")
    assert (tmp_path / "run.yaml").read_text() == good.replace("max_steps: 2", "max_steps: 2")
    _one_line(cli_here("init", "no/such/run.yaml", cwd=str(tmp_path)), "does not exist")
    assert cli_here("init", "run.yaml", "--force", cwd=str(tmp_path)).returncode == 0
    assert "autopar train" in (tmp_path / "run.yaml").read_text()


def test_the_example_config_trains_as_written(tmp_path) -> None:
    start = time.perf_counter()
    ran = _autopar("train", str(ROOT / "examples" / "run_config.yaml"), cwd=tmp_path)
    seconds = time.perf_counter() - start
    assert ran.returncode == 0, ran.stderr[-3000:]
    records = _losses(tmp_path / "autopar-example-run")
    assert len(records) == 40 and records[-1]["loss"] < records[0]["loss"]
    print(f"autopar train examples/run_config.yaml: {seconds:.1f} s")


@pytest.mark.dist
def test_a_config_under_dp2_tp2_equals_the_run_built_from_flags(tmp_path) -> None:
    """`autopar train cfg.yaml` on 4 gloo processes (dp2 x tp2) and `autopar data prepare` +
    `autopar compile` + `autopar run` with the same settings, every default stated: the same
    token ids, the same plan, the same losses."""
    text = tmp_path / "text.jsonl"
    shutil.copy(TEXT_SETS["tiny-text"], text)
    (tmp_path / "cfg.yaml").write_text(
        "model: tiny-llama\ndata: {train: {path: text.jsonl}}\n"
        "plan: {constraints: {dp: 2, tp: 2}, cluster: cpu}\n"
        "training: {output_dir: from-config, max_steps: 6, global_batch_size: 8, "
        "max_seq_length: 32, learning_rate: 3.0e-3, lr_scheduler_type: cosine, "
        "warmup_steps: 2, min_lr: 3.0e-4, weight_decay: 0.1, adam_beta1: 0.9, "
        "adam_beta2: 0.95, adam_epsilon: 1.0e-8, max_grad_norm: 1.0, seed: 7, "
        "save_strategy: 'no', logging_steps: 1, use_cpu: true}\n")
    from_config = _autopar("train", "cfg.yaml", cwd=tmp_path, nproc=4)
    assert from_config.returncode == 0, from_config.stderr[-3000:]
    a = tmp_path / "from-config"
    # the same text through `autopar data prepare` with the model's tokenizer.json: the
    # Trainer encodes without BOS and ends each document with the end-of-text id, as it does
    made = cli_here("data", "prepare", str(text), "--out", str(tmp_path / "tok" / "text"),
                    "--tokenizer", str(TINY_TOKENIZER), "-q")
    assert made.returncode == 0, made.stderr
    assert (tmp_path / "tok" / "text.bin").read_bytes() == (a / "data" / "train.bin").read_bytes()
    ours, theirs = TokenDataset(a / "data" / "train"), TokenDataset(tmp_path / "tok" / "text")
    assert (ours.num_documents, ours.vocab_size, ours.eos_id) == (
        theirs.num_documents, theirs.vocab_size, theirs.eos_id)
    assert ours.eos_id is not None  # both keep packed documents apart by the same token
    b = tmp_path / "from-flags"
    compiled = cli_here("compile", "tiny-llama", "--devices", "4", "--global-batch", "8",
                        "--seq", "32", "--cluster", "cpu", "--constraints", "dp=2,tp=2",
                        "--out", str(b), "-q")
    assert compiled.returncode == 0, compiled.stderr
    plan_a, plan_b = autopar.Plan.load(a / "plan.yaml"), autopar.Plan.load(b / "plan.yaml")
    assert plan_a.to_dict() == plan_b.to_dict()
    # autopar run's defaults are not TrainingArguments': every setting passed
    from_flags = _autopar("run", str(b), "--data", str(tmp_path / "tok" / "text"),
                          "--steps", "6", "--seed", "7", "--lr", "3e-3", "--lr-schedule",
                          "cosine", "--warmup-steps", "2", "--decay-steps", "6", "--min-lr",
                          "3e-4", "--weight-decay", "0.1", "--betas", "0.9,0.95", "--eps",
                          "1e-8", "--grad-clip", "1.0", "--device", "cpu", "--no-final-save",
                          cwd=tmp_path, nproc=4)
    assert from_flags.returncode == 0, from_flags.stderr[-3000:]
    expected, got = _losses(b), _losses(a)
    assert [r["step"] for r in got] == list(range(6))
    assert [r["lr"] for r in got] == pytest.approx([r["lr"] for r in expected], rel=1e-12)
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in expected], abs=1e-5)
    assert got[-1]["loss"] < got[0]["loss"]
