"""``autopar compile --task infer`` then ``autopar run DIR --generate``: the artifact's own
generate.py serves the prompts (seed-0 weights, or the latest checkpoint of a trained artifact
re-compiled for serving); edits kept, plan changes regenerate; bad inputs fail in one line
with exit 2 and leave the artifact as it was."""

from __future__ import annotations

import json

import pytest

import autopar

from .test_inspect import _assert_one_line_error, cli_here, run_cli

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12], [20, 21, 22], [30, 31, 32, 33, 34]]
NEW = 6


def _compile(art, task: str = "infer") -> None:
    made = cli_here("compile", "tiny-llama", "--devices", "1", "--seq", "16", "--global-batch",
                    "2", "--cluster", "cpu", "--task", task, "--out", str(art), "-q")
    assert made.returncode == 0, made.stderr


def _rows(stdout: str) -> list[list[int]]:
    return [json.loads(line)["new_ids"] for line in stdout.splitlines()]


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "p.jsonl"
    path.write_text("".join(json.dumps({"ids": p}) + "\n" for p in PROMPTS))
    return path


@pytest.fixture(scope="module")
def serving(tmp_path_factory):
    """A 1-device serving artifact of tiny Llama (never trained)."""
    art = tmp_path_factory.mktemp("serve") / "art"
    _compile(art)
    return art


def _snapshot(art) -> dict:
    return {p.relative_to(art): p.read_bytes() for p in sorted(art.rglob("*")) if p.is_file()}


def test_compile_infer_then_run_generate(serving, prompts) -> None:
    art = serving
    assert (art / "generate.py").is_file() and not (art / "train.py").exists()
    assert json.loads((art / "manifest.json").read_text())["program"]["file"] == "generate.py"
    result = run_cli("run", str(art), "--generate", "--prompts", str(prompts),
                     "--max-new-tokens", str(NEW))
    assert result.returncode == 0, result.stderr
    # autopar run's seed-0 weights (no checkpoint yet), as one process's Generator has them
    expected = autopar.Generator("tiny-llama").generate(PROMPTS, max_new_tokens=NEW)
    assert _rows(result.stdout) == expected[:, -NEW:].tolist()
    assert "tokens/s" in result.stderr
    # an infer artifact given prompts serves without --generate too; a stop token cuts rows
    eos = expected[1, -NEW + 2].item()
    stopped = cli_here("run", str(art), "--prompts", str(prompts), "--max-new-tokens",
                       str(NEW), "--eos", str(eos))
    assert stopped.returncode == 0, stopped.stderr
    from autopar.serve.generate import new_tokens

    cut = new_tokens(autopar.Generator("tiny-llama").generate(
        PROMPTS, max_new_tokens=NEW, eos_token_id=eos), PROMPTS, eos)
    assert _rows(stopped.stdout) == cut and cut[1][-1] == eos and len(cut[1]) < NEW
    sampled = [cli_here("run", str(art), "--generate", "--prompts", str(prompts), "--sample",
                        "--temperature", "1.5", "--seed", "3").stdout for _ in range(2)]
    assert sampled[0] == sampled[1] and len(_rows(sampled[0])) == len(PROMPTS)


def test_generate_py_run_as_a_script_serves_as_autopar_run(serving, prompts) -> None:
    """The program's own __main__ reads autopar run's options and checks the same inputs."""
    import subprocess
    import sys

    script = [sys.executable, str(serving / "generate.py")]
    ran = subprocess.run([*script, "--prompts", str(prompts), "--max-new-tokens", str(NEW)],
                         capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr
    expected = autopar.Generator("tiny-llama").generate(PROMPTS, max_new_tokens=NEW)
    assert _rows(ran.stdout) == expected[:, -NEW:].tolist()
    missing = subprocess.run([*script, "--prompts", str(prompts) + ".nope"],
                             capture_output=True, text=True, timeout=300)
    _assert_one_line_error(missing, "no such file")


def test_plan_edits_regenerate_and_program_edits_are_kept(serving, prompts) -> None:
    art = serving
    program = art / "generate.py"
    plan = art / "plan.yaml"
    plan.write_text(plan.read_text() + "# a note\n")  # plan.yaml changed: regenerated
    again = cli_here("run", str(art), "--generate", "--prompts", str(prompts),
                     "--max-new-tokens", "2")
    assert again.returncode == 0 and "regenerated" in again.stderr
    manifest = json.loads((art / "manifest.json").read_text())
    from autopar.artifact import digest

    assert manifest["program"]["plan_sha256"] == digest(plan.read_bytes())
    # a hand edit runs as it is, and is said: this one always picks the least likely token
    edited = program.read_text().replace("else last.argmax(-1)", "else last.argmin(-1)")
    program.write_text(edited)
    ran = cli_here("run", str(art), "--generate", "--prompts", str(prompts),
                   "--max-new-tokens", "2")
    assert ran.returncode == 0 and "edited by hand" in ran.stderr
    assert program.read_text() == edited
    greedy = autopar.Generator("tiny-llama").generate(PROMPTS, max_new_tokens=2)
    assert _rows(ran.stdout) != greedy[:, -2:].tolist()
    # re-compiling keeps the edited program beside the new one
    _compile(art)
    assert (art / "generate.edited.py").read_text() == edited
    assert program.read_text() != edited


def test_a_trained_artifact_recompiled_for_serving_serves_its_checkpoint(tmp_path,
                                                                       prompts) -> None:
    art = tmp_path / "art"
    _compile(art, task="train")
    trained = cli_here("run", str(art), "--steps", "2", "--device", "cpu", "--lr", "0.05")
    assert trained.returncode == 0, trained.stderr
    _compile(art)  # the same directory, now for serving: the checkpoints stay
    assert (art / "generate.py").is_file() and not (art / "train.py").exists()
    served = cli_here("run", str(art), "--generate", "--prompts", str(prompts),
                      "--max-new-tokens", str(NEW))
    assert served.returncode == 0, served.stderr
    expected = autopar.Generator(art).generate(PROMPTS, max_new_tokens=NEW)  # the checkpoint
    assert _rows(served.stdout) == expected[:, -NEW:].tolist()
    fresh = autopar.Generator("tiny-llama").generate(PROMPTS, max_new_tokens=NEW)
    assert not (expected == fresh).all()  # the trained weights, not the seed-0 ones


def test_serving_bad_inputs_exit_2_with_one_line(prompts, tmp_path, monkeypatch) -> None:
    art = tmp_path / "art"
    _compile(art)
    before = _snapshot(art)
    text = tmp_path / "q.txt"
    text.write_text("hello\n")
    serve = ("run", str(art), "--generate", "--prompts", str(prompts))
    for args, needles in [
        (("run", str(art)), ("--generate --prompts FILE",)),
        (("run", str(art), "--generate"), ("needs prompts",)),
        (("run", str(art), "--generate", "--prompts", str(tmp_path / "none.jsonl")),
         ("no such file",)),
        (("run", str(art), "--generate", "--prompts", str(text)), ("--tokenizer",)),
        ((*serve, "--max-new-tokens", "0"), ("max_new_tokens",)),
        ((*serve, "--sample", "--temperature", "0"), ("temperature",)),
        ((*serve, "--top-p", "1.5"), ("top_p",)),
        ((*serve, "--resume"), ("--resume",)),
        (("run", str(tmp_path / "nowhere"), "--generate", "--prompts", str(prompts)),
         ("not an autopar artifact",)),
    ]:
        _assert_one_line_error(cli_here(*args), *needles)
    monkeypatch.setenv("WORLD_SIZE", "2")
    _assert_one_line_error(cli_here(*serve), "without torchrun")
    monkeypatch.delenv("WORLD_SIZE")
    assert _snapshot(art) == before  # nothing written, nothing regenerated
    # a training artifact: --generate and --prompts say what serves
    trains = tmp_path / "trains"
    _compile(trains, task="train")
    _assert_one_line_error(cli_here("run", str(trains), "--generate", "--prompts",
                                    str(prompts)), "--task infer", "autopar generate")
    _assert_one_line_error(cli_here("run", str(trains), "--prompts", str(prompts)),
                           "--generate")
    # a hand-edited program that does not load, or lacks what autopar run calls
    program = art / "generate.py"
    program.write_text(program.read_text() + "\ndef broken(:\n")
    _assert_one_line_error(cli_here(*serve), "generate.py:", "delete it")
    program.write_text(before[program.relative_to(art)].decode().replace("def generate(",
                                                                        "def generated("))
    _assert_one_line_error(cli_here(*serve), "defines no generate()")
