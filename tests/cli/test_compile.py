"""``autopar compile`` as a user runs it."""

from __future__ import annotations

import json

from autopar.plan import Plan

from .test_inspect import _assert_one_line_error, cli_here, run_cli


def test_compile_writes_plan_and_prints_report(tmp_path) -> None:
    out = tmp_path / "art"
    result = run_cli("compile", "tiny-llama", "--devices", "4", "--global-batch", "8",
                     "--seq", "64", "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert "mesh" in result.stdout and "step time" in result.stdout
    plan = Plan.load(out / "plan.yaml")
    assert plan.devices == 4 and plan.global_batch == 8


def test_compile_json(tmp_path) -> None:
    result = run_cli("compile", "tiny-llama", "--devices", "2", "--seq", "32", "--format", "json",
                     "--out", str(tmp_path / "j"), "--constraints", "pp=2")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["mesh"]["pp"] == 2 and data["plan_file"].endswith("plan.yaml")


def test_compile_bad_inputs_exit_2_and_write_nothing(tmp_path) -> None:
    out = tmp_path / "never"
    base = ["compile", "tiny-llama", "--seq", "32", "--out", str(out)]
    _assert_one_line_error(run_cli(*base, "--devices", "4", "--constraints", "tp=3"), "tp=3")
    _assert_one_line_error(cli_here(*base, "--devices", "4", "--constraints", "nope=1"), "nope")
    _assert_one_line_error(cli_here(*base, "--devices", "4", "--cluster", "tpu-v9"), "tpu-v9")
    _assert_one_line_error(cli_here(*base, "--devices", "4", "--memory-limit-gb", "0.0001"),
                           "no plan fits")
    _assert_one_line_error(cli_here(*base, "--devices", "0"), "--devices")
    _assert_one_line_error(cli_here("compile", "tiny-llama"), "--devices")
    assert not out.exists()


def test_an_encoder_decoder_config_is_refused_in_one_line(tmp_path) -> None:
    config = tmp_path / "t5" / "config.json"
    config.parent.mkdir()
    config.write_text(json.dumps({
        "model_type": "t5", "architectures": ["T5ForConditionalGeneration"], "d_model": 64,
        "d_ff": 128, "num_layers": 2, "num_heads": 4, "d_kv": 16, "vocab_size": 128}))
    out = tmp_path / "art"
    done = cli_here("compile", str(config), "--devices", "2", "--out", str(out))
    assert done.returncode == 2
    assert "T5ForConditionalGeneration) is not a causal language model" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
    assert not out.exists()


def test_compile_replans_without_sequence_parallelism_the_runtime_cannot_lay_out(tmp_path
                                                                                ) -> None:
    """DeepSeek-V2-Lite on tp=8: the search picks sequence parallelism, which the runtime cannot
    lay out over MLA's split heads beside its whole down-projection (nor over the MoE block's
    whole router beside its split shared expert); compile says so and plans again without it.
    Pinned by the user (tiny DeepSeek-V2), it is refused in one line, nothing written."""
    out = tmp_path / "art"
    result = cli_here("compile", "deepseek-v2-lite", "--devices", "8", "--global-batch", "8",
                      "--constraints", "tp=8", "--out", str(out), "-q")
    assert result.returncode == 0, result.stderr
    assert "keeps model.layers.0.self_attn.kv_a_proj_with_mqa whole" in result.stderr
    assert "planning without sequence parallelism" in result.stderr
    plan = Plan.load(out / "plan.yaml")
    assert plan.mesh["tp"] == 8 and not plan.sequence_parallel
    base = ["compile", "tiny-deepseek-v2", "--devices", "2", "--global-batch", "4", "--seq",
            "32"]
    never = tmp_path / "never"
    _assert_one_line_error(cli_here(*base, "--constraints",
                                    "tp=2,precision=fp32,sequence_parallel=true",
                                    "--out", str(never)), "sequence_parallel=false")
    assert not never.exists()
