"""``autopar report``, ``diff`` and ``explain`` as a user runs them, and every error path."""

from __future__ import annotations

import json

import pytest
import yaml

from autopar.cli import main

from .test_inspect import _assert_one_line_error, cli_here, run_cli


@pytest.fixture(scope="module")
def plans(tmp_path_factory) -> tuple:
    """Two artifacts of tiny-llama: the searched plan, and one with a pinned pipeline."""
    root = tmp_path_factory.mktemp("plans")
    a, b = root / "a", root / "b"
    base = ["compile", "tiny-llama", "--devices", "4", "--global-batch", "16", "--seq", "64",
            "-q"]
    for out, extra in ((a, []), (b, ["--constraints", "pp=2"])):
        result = cli_here(*base, *extra, "--out", str(out))
        assert result.returncode == 0, result.stderr
    return a, b


def test_report_formats(plans, tmp_path, capsys) -> None:
    a, _ = plans
    text = run_cli("report", str(a))
    assert text.returncode == 0 and "Why this plan" in text.stdout and text.stderr == ""
    out = tmp_path / "r.html"
    html = cli_here("report", str(a / "plan.yaml"), "--out", str(out))
    assert html.returncode == 0 and html.stdout == "" and f"wrote {out}" in html.stderr
    assert out.read_text().startswith("<!doctype html>")
    with pytest.raises(SystemExit) as exc:
        main(["report", str(a), "--format", "json"])
    assert exc.value.code == 0
    data = json.loads(capsys.readouterr().out)
    assert data["summary"]["mesh"] == yaml.safe_load((a / "plan.yaml").read_text())["mesh"]
    assert [p.name for p in tmp_path.iterdir()] == ["r.html"]  # no temporary files left


def test_diff_and_explain(plans, capsys) -> None:
    a, b = plans
    diff = cli_here("diff", str(a), str(b))
    assert diff.returncode == 0, diff.stderr
    assert "pp " in diff.stdout and "B is " in diff.stdout and "What changed" in diff.stdout
    explain = cli_here("explain", str(b), "--block", "model.layers.1")
    assert explain.returncode == 0, explain.stderr
    assert "recompute:" in explain.stdout and "self_attn.q_proj" in explain.stdout
    with pytest.raises(SystemExit):
        main(["explain", str(b), "--node", "mlp.up_proj", "--format", "json"])
    assert json.loads(capsys.readouterr().out)["matches"][0]["module"] == "mlp.up_proj"


def _help(capsys, *command: str) -> str:
    with pytest.raises(SystemExit) as exc:
        main([*command, "--help"])
    assert exc.value.code == 0
    return capsys.readouterr().out


def test_every_command_has_help_with_examples(capsys) -> None:
    for command in (["compile"], ["report"], ["diff"], ["explain"], ["inspect"], ["profile"],
                    ["run"], ["data"], ["data", "prepare"]):
        assert "Examples:" in _help(capsys, *command), command
    listing = _help(capsys)
    for name in ("compile", "report", "diff", "explain", "inspect", "profile", "run", "data"):
        assert f"  {name} " in listing


def _fails(capsys, *args: str) -> str:
    """Run the CLI in-process: exit code 2, one line on stderr, nothing on stdout."""
    with pytest.raises(SystemExit) as exc:
        main(list(args))
    captured = capsys.readouterr()
    assert exc.value.code == 2, captured.err
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("autopar: error:"), captured.err
    assert "Traceback" not in captured.err
    return lines[0]


def test_error_paths_are_one_line_exit_2_and_write_nothing(plans, tmp_path, capsys) -> None:
    a, b = plans
    out = tmp_path / "out.html"
    broken = tmp_path / "broken.yaml"
    broken.write_text("mesh: [unclosed")
    old = yaml.safe_load((a / "plan.yaml").read_text())
    old["version"] = 1
    old.pop("explain")
    legacy = tmp_path / "legacy.yaml"
    legacy.write_text(yaml.safe_dump(old))
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = [
        (("report", str(tmp_path / "missing.yaml"), "--out", str(out)), "cannot read plan"),
        (("report", str(broken), "--out", str(out)), "not valid YAML"),
        (("report", str(empty), "--out", str(out)), "without plan.yaml"),
        (("report", str(a), "--out", str(tmp_path / "no" / "r.html")), "does not exist"),
        (("report", str(a), "--out", str(empty)), "is a directory"),
        (("report", str(a), "--format", "pdf", "--out", str(out)), "pdf"),
        (("diff", str(a), str(tmp_path / "missing.yaml"), "--out", str(out)),
         "cannot read plan"),
        (("diff", str(a)), "PLAN_B"),
        (("explain", str(a), "--block", "99"), "no block '99'"),
        (("explain", str(a), "--block", "model.layers.77"), "no block"),
        (("explain", str(a), "--node", "nope.proj"), "no op or module 'nope.proj'"),
        (("explain", str(a), "--block", "1", "--node", "mlp"), "not both"),
        (("explain", str(legacy), "--block", "1"), "no explain data"),
        (("explain", str(a), "--format", "html"), "html"),
        (("no-such-command",), "no-such-command"),
    ]
    for args, needle in cases:
        assert needle in _fails(capsys, *args), args
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken.yaml", "empty", "legacy.yaml"]
    assert list(empty.iterdir()) == []


def test_report_run_refuses_a_plan_file_and_an_artifact_never_run(plans, tmp_path) -> None:
    """--run reads DIR/logs: a plan file has none, an artifact that was never run has none, a
    damaged log is named; one line, exit 2, nothing written."""
    import shutil

    a, _ = plans
    out = tmp_path / "run.html"
    _assert_one_line_error(run_cli("report", str(a / "plan.yaml"), "--run", "--out", str(out)),
                           "--run reads a run's logs from its artifact directory", "plan.yaml")
    _assert_one_line_error(cli_here("report", str(a), "--run"), "has no run to compare",
                           "autopar run", "--profile")
    damaged = tmp_path / "damaged"
    shutil.copytree(a, damaged)
    (damaged / "logs").mkdir()
    (damaged / "logs" / "train.jsonl").write_text('{"step": 0, "loss": 5.5}\n{"step": 1, "lo\n'
                                                  '{"step": 2, "loss": 5.0}\n')
    _assert_one_line_error(cli_here("report", str(damaged), "--run", "--out", str(out)),
                           "train.jsonl:2 is not a JSON line")
    assert not out.exists()


def test_a_log_cut_short_by_a_crash_is_read_up_to_its_last_whole_line(tmp_path, capsys) -> None:
    from autopar.report.run import _jsonl

    log = tmp_path / "train.jsonl"
    log.write_text('{"step": 0, "loss": 5.5}\n{"step": 1, "loss": 5.4}\n{"step": 2, "lo')
    assert [r["step"] for r in _jsonl(log)] == [0, 1]
    assert "train.jsonl:3: skipped a line cut short" in capsys.readouterr().err
