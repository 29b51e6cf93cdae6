"""``autopar inspect`` as a user runs it: a subprocess, its stdout, stderr and exit code."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap


def run_cli(*args: str, cwd: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "autopar", *args], capture_output=True,
                          text=True, timeout=120, cwd=cwd)


def cli_here(*args: str, cwd: str | None = None) -> subprocess.CompletedProcess:
    """:func:`run_cli` in this process: the CLI's own entry point (the same error handling,
    exit codes and output), without a new interpreter's seconds of imports. For error paths
    after a test's first, real-process call. ``cwd`` is also importable, as under -m."""
    import contextlib
    import io
    import os

    from autopar.cli import main

    out, err = io.StringIO(), io.StringIO()
    here = os.getcwd()
    if cwd is not None:
        os.chdir(cwd)
        sys.path.insert(0, str(cwd))
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main(list(args))
                code = 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    finally:
        if cwd is not None:
            os.chdir(here)
            sys.path.remove(str(cwd))
    return subprocess.CompletedProcess(["autopar", *args], code, out.getvalue(), err.getvalue())


def test_inspect_json_reports_exact_params() -> None:
    from autopar.models import build_model

    result = run_cli("inspect", "tiny-llama", "--seq", "32", "--format", "json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    model = build_model("tiny-llama")
    assert data["params"] == sum(p.numel() for p in model.parameters())
    assert data["tokens"] == 32
    assert [t["count"] for t in data["block_types"]] == [1, 4, 1]


def test_inspect_text_names_blocks_and_largest_tensors() -> None:
    result = run_cli("inspect", "tiny-mixtral", "--seq", "16")
    assert result.returncode == 0, result.stderr
    assert "4 x moe" in result.stdout
    assert "largest tensors" in result.stdout
    assert "experts.gate_up_proj" in result.stdout


def test_inspect_module_factory(tmp_path) -> None:
    (tmp_path / "mymodels.py").write_text(textwrap.dedent("""
        import torch
        from autopar.models import GPT, GPTConfig
        def make():
            return GPT(GPTConfig(n_layers=3)), (torch.zeros(1, 64, dtype=torch.long),)
    """))
    result = run_cli("inspect", "mymodels:make", "--format", "json", cwd=str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["block_types"][1]["count"] == 3


def _assert_one_line_error(result: subprocess.CompletedProcess, *needles: str) -> None:
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("autopar: error:")
    assert "Traceback" not in result.stderr
    for needle in needles:
        assert needle in lines[0]


def test_bad_inputs_exit_2_with_one_line(tmp_path) -> None:
    _assert_one_line_error(run_cli("inspect", "no-such-model"), "no-such-model", "tiny-llama")
    _assert_one_line_error(cli_here("inspect", "tiny-llama", "--seq", "0"), "--seq")
    _assert_one_line_error(cli_here("inspect", "nomodule_xyz:make"), "nomodule_xyz")
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    _assert_one_line_error(cli_here("inspect", str(broken)), "broken.json")
    _assert_one_line_error(cli_here("inspect", str(tmp_path / "missing.onnx")), "missing.onnx")
    _assert_one_line_error(cli_here("no-such-command"), "no-such-command")


def test_help_lists_commands_and_examples() -> None:
    result = run_cli("--help")
    assert result.returncode == 0 and "inspect" in result.stdout
    result = run_cli("inspect", "--help")
    assert result.returncode == 0 and "Examples:" in result.stdout
