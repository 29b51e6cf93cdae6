"""The CLI's bad-input table (docs/trust.md, "Bad input"): every row runs here.

One list, :data:`ROWS`, drives both checks: each row's command, run in a scratch directory
that holds the files it names, must exit 2 with exactly the one line the row gives (and
nothing on stdout, no traceback), and leave the directory as it was (nothing written); and
docs/trust.md must hold the row as a line of its table. Paths in commands are relative to the
scratch directory, so the printed lines are the same on every machine.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

import pytest
import yaml

from .test_inspect import cli_here

TRUST = Path(__file__).resolve().parents[2] / "docs" / "trust.md"


class Row(NamedTuple):
    """One bad input: the command (after ``autopar``), what is wrong, the line it prints."""

    command: str
    wrong: str
    prints: str


ROWS: list[Row] = [
    Row('no-such-command',
        'an unknown command',
        "autopar: error: No such command 'no-such-command'. (see 'autopar --help')"),
    Row('inspect tiny-llama --format xml',
        'an output format autopar does not write',
        "autopar: error: Invalid value for '--format': 'xml' is not one of 'text', 'json'. (see 'autopar inspect --help')"),
    Row('inspect tiny-llama --seq 0',
        'a sequence length below 1',
        "autopar: error: Invalid value for '--seq': 0 is not in the range x>=1. (see 'autopar inspect --help')"),
    Row('inspect nomodule_xyz:make',
        'a factory whose module does not import',
        "autopar: error: cannot import 'nomodule_xyz' for model 'nomodule_xyz:make': No module named 'nomodule_xyz'; check the module name and PYTHONPATH"),
    Row('inspect broken.json',
        'a config.json that is not JSON',
        'autopar: error: cannot read model config broken.json: Expecting property name enclosed in double quotes: line 1 column 2 (char 1); fix the JSON'),
    Row('inspect missing.onnx',
        'an ONNX file that does not exist',
        "autopar: error: cannot read missing.onnx: no such file; check the path, or export the model with torch.onnx.export(model, args, 'missing.onnx', dynamo=True)"),
    Row('compile t5/config.json --devices 2',
        'an encoder-decoder config',
        "autopar: error: a t5 config (T5ForConditionalGeneration) is not a causal language model, which is what autopar builds from a Hugging Face config (encoder-decoders such as T5 and vision models are not supported from config.json); build it yourself and pass a 'module:factory'"),
    Row('compile tiny-llama',
        'no --devices',
        "autopar: error: Missing option '--devices'. (see 'autopar compile --help')"),
    Row('compile tiny-llama --devices 0',
        'zero devices',
        "autopar: error: Invalid value for '--devices': 0 is not in the range x>=1. (see 'autopar compile --help')"),
    Row('compile tiny-llama --devices 4 --constraints nope=1 --out new',
        'an unknown constraint',
        "autopar: error: constraints: unknown constraint 'nope'; use pp, dp, cp, tp, ep, microbatch_size, num_microbatches, zero_stage, virtual_stages, recompute, offload, schedule, sequence_parallel, precision, engine, vocab_parallel, model, cp_mode, stage_layers, stages, capacity_factor"),
    Row('compile tiny-llama --devices 4 --cluster tpu-v9 --out new',
        'an unknown cluster',
        "autopar: error: unknown cluster 'tpu-v9': use one of a100-40g, a100-80g, ascend-910b, b200, cpu, h100-80g, h200, v100-16g or a profile YAML written by `autopar profile`"),
    Row('compile tiny-llama --devices 2 --out .',
        '--out the current directory (not an artifact)',
        'autopar: error: --out . is the current directory or one of its parents; choose a new directory for the artifact, such as --out art'),
    Row('sweep tiny-llama --devices 8,x --out s.html',
        'a device count that is not a number',
        "autopar: error: Invalid value for '--devices': 'x' is not a device count: give positive integers (8,16,64) or a doubling range (8..1024) (see 'autopar sweep --help')"),
    Row('sweep tiny-llama --devices 8..4 --out s.html',
        'a range that runs backwards',
        "autopar: error: Invalid value for '--devices': a device range runs from a positive count up: got 8..4 (see 'autopar sweep --help')"),
    Row('sweep tiny-llama --devices 4 --out no/s.html',
        'an --out folder that does not exist',
        'autopar: error: cannot write no/s.html: folder no does not exist; create it or choose another --out'),
    Row('report missing.yaml',
        'a plan file that does not exist',
        'autopar: error: cannot read plan missing.yaml: No such file or directory; check the path'),
    Row('report broken.yaml',
        'a plan file that is not YAML',
        'autopar: error: plan broken.yaml is not valid YAML (while parsing a flow sequence in "<unicode string>", line 1, column 7 did not find expected \',\' or \']\' in "<unicode string>", line 2, column 1); fix the file or re-plan'),
    Row('report future.yaml',
        'a plan of an unknown format version',
        'autopar: error: future.yaml has plan format version 99, this autopar reads versions 1, 2, 3; re-run `autopar compile` to re-plan'),
    Row('report mesh-word.yaml',
        'a plan field of the wrong type (mesh.pp: one)',
        "autopar: error: mesh-word.yaml: mesh.pp: input should be a valid integer, got 'one'; fix the field or re-plan with autopar compile"),
    Row('report quoted-cluster.yaml',
        'a cluster name with quotes and a line break',
        'autopar: error: quoted-cluster.yaml: cluster: must be a cluster name (letters, digits, spaces and _.+-@:/), got \'cpu"""\\nopen("CANARY", "w")\'; fix the field or re-plan with autopar compile'),
    Row('report extra-key.yaml',
        'a field the plan does not have',
        "autopar: error: extra-key.yaml: missing or unknown field ('surprise' is not a plan field); remove it, or re-plan"),
    Row('report uncovered.yaml',
        'a mesh that does not cover the devices',
        "autopar: error: uncovered.yaml: mesh {'pp': 1, 'dp': 2, 'cp': 1, 'ep': 1, 'tp': 1} covers 2 devices but devices is 1; make pp*dp*cp*ep*tp equal devices"),
    Row('report art --run',
        '--run for an artifact that never ran',
        'autopar: error: art has no run to compare: train it first (torchrun ... -m autopar run art --profile), then report --run'),
    Row('explain missing.yaml',
        'a plan file that does not exist',
        'autopar: error: cannot read plan missing.yaml: No such file or directory; check the path'),
    Row('diff art/plan.yaml missing.yaml',
        'a second plan that does not exist',
        'autopar: error: cannot read plan missing.yaml: No such file or directory; check the path'),
    Row('run empty',
        'a directory that is not an artifact',
        'autopar: error: empty is not an autopar artifact (no manifest.json); create one with `autopar compile MODEL --devices N --out empty`'),
    Row('run corrupt',
        'a manifest.json that is not JSON',
        'autopar: error: corrupt/manifest.json is corrupt (Expecting property name enclosed in double quotes); re-run autopar compile'),
    Row('run future',
        'a manifest of an unknown version',
        'autopar: error: future/manifest.json has manifest version 99, this autopar reads 2; re-run autopar compile'),
    Row('run art --steps 4 --device cpu --betas 0.9',
        'one Adam beta',
        "autopar: error: Invalid value for '--betas': '0.9' is not two numbers like 0.9,0.95 (see 'autopar run --help')"),
    Row('run art --steps 4 --device cpu --warmup-steps 9',
        'more warm-up steps than steps',
        "autopar: error: 9 warm-up steps exceed the schedule's 4 steps; lower --warmup-steps or raise --decay-steps"),
    Row('run art --steps 4 --device cpu --profile --profile-steps 3:2',
        'a profile window that ends before it starts',
        "autopar: error: Invalid value for '--profile-steps': '3:2' needs 0 <= START < END (steps START..END-1 are recorded) (see 'autopar run --help')"),
    Row('run art --prompts prompts.jsonl',
        'prompts without --generate',
        'autopar: error: --prompts goes with --generate, which serves an artifact compiled with --task infer; art trains (task train)'),
    Row('export empty out --to hf',
        'export from a directory that is not an artifact',
        'autopar: error: empty is not an autopar artifact (no manifest.json); create one with `autopar compile MODEL --devices N --out empty`'),
    Row('generate tiny-llama --prompts ids.jsonl',
        'prompt ids that are not integers',
        'autopar: error: ids.jsonl:1: "ids" must be a non-empty list of token ids (integers >= 0), found \'a\''),
    Row('profile --base cpu --out box.yaml',
        '--base without --from-run',
        'autopar: error: --base goes with --from-run: it names the cluster file the fit starts from'),
    Row('data prepare missing.txt --out tok',
        'an input file that does not exist',
        'autopar: error: missing.txt: input file not found; check the path'),
]


def _listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    """A directory holding every file the rows name: a compiled artifact (art), broken and
    edited copies of its plan, non-artifacts and bad inputs."""
    root = tmp_path_factory.mktemp("bad-inputs")
    made = cli_here("compile", "tiny-llama", "--devices", "1", "--seq", "32", "--global-batch",
                    "2", "--cluster", "cpu", "--out", str(root / "art"), "-q")
    assert made.returncode == 0, made.stderr
    plan = yaml.safe_load((root / "art" / "plan.yaml").read_text())
    edits = {"future.yaml": {"version": 99},
             "mesh-word.yaml": {"mesh": {**plan["mesh"], "pp": "one"}},
             "quoted-cluster.yaml": {"cluster": 'cpu"""\nopen("CANARY", "w")'},
             "extra-key.yaml": {"surprise": 1},
             "uncovered.yaml": {"mesh": {**plan["mesh"], "dp": 2}}}
    for name, change in edits.items():
        (root / name).write_text(yaml.safe_dump({**plan, **change}, sort_keys=False))
    (root / "broken.yaml").write_text("mesh: [unclosed")
    (root / "broken.json").write_text("{")
    (root / "t5").mkdir()
    (root / "t5" / "config.json").write_text(json.dumps(
        {"model_type": "t5", "architectures": ["T5ForConditionalGeneration"], "d_model": 64,
         "num_layers": 2, "num_heads": 2, "d_kv": 32, "d_ff": 128, "vocab_size": 256}))
    (root / "empty").mkdir()
    (root / "corrupt").mkdir()
    (root / "corrupt" / "manifest.json").write_text("{broken")
    (root / "future").mkdir()
    (root / "future" / "manifest.json").write_text(json.dumps({"manifest_version": 99}))
    (root / "prompts.jsonl").write_text(json.dumps({"prompt": "hello"}) + "\n")
    (root / "ids.jsonl").write_text(json.dumps({"ids": ["a", 2]}) + "\n")
    return root


def _one_line(result) -> str:
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert result.stdout == "" and "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


@pytest.mark.parametrize("row", ROWS, ids=[r.command for r in ROWS])
def test_every_bad_input_exits_2_with_its_one_line_and_writes_nothing(scratch, row) -> None:
    before = _listing(scratch)
    line = _one_line(cli_here(*row.command.split(), cwd=str(scratch)))
    assert line == row.prints
    assert _listing(scratch) == before


def _table_line(row: Row) -> str:
    """The row in markdown: the printed line in a double-backtick span (it may hold single
    backticks), its pipes escaped (they would end the cell)."""
    line = row.prints.removeprefix("autopar: error: ").replace("|", "\\|")
    return f"| `autopar {row.command}` | {row.wrong} | `` {line} `` |"


def test_the_table_in_docs_trust_md_is_these_rows() -> None:
    assert len(ROWS) >= 30
    text = TRUST.read_text()
    assert "## Bad input" in text
    section = text.split("## Bad input", 1)[1].split("\n## ", 1)[0]
    missing = [r.command for r in ROWS if _table_line(r) not in section.splitlines()]
    assert not missing, f"docs/trust.md lacks the rows of {missing}"


def render_table() -> str:
    """The table as docs/trust.md holds it (``python -m tests.cli.test_bad_inputs``)."""
    return "\n".join(["| command | what is wrong | the line after `autopar: error:` (exit 2) |",
                      "|---|---|---|", *map(_table_line, ROWS)])


if __name__ == "__main__":
    print(render_table())
