"""Plan -> Megatron-LM arguments -> constraints -> the same plan."""

from __future__ import annotations

import pytest

import autopar
from autopar.plan.megatron import constraints_from_megatron, megatron_command

from ..cli.test_inspect import cli_here, run_cli

SAME = ("mesh", "zero_stage", "microbatch_size", "num_microbatches", "sequence_parallel",
        "precision", "recompute", "schedule")


@pytest.mark.parametrize("name,pins", [
    ("llama3-70b", dict(tp=8, pp=1, zero_stage=2, recompute="full", sequence_parallel=True)),
    ("llama3-8b", dict(tp=1, pp=2, zero_stage=1, recompute="none", schedule="interleaved",
                       virtual_stages=2)),
    ("llama3-8b", dict(tp=2, pp=1, zero_stage=2, recompute="selective")),
], ids=["70b-tp8-sp-full", "8b-pp2-interleaved", "8b-tp2-selective"])
def test_megatron_arguments_pin_the_same_plan(name: str, pins: dict, tmp_path) -> None:
    graph = autopar.capture(name, seq=4096)
    plan = autopar.plan(graph, devices=64, global_batch=512, constraints=pins)
    command = megatron_command(plan)
    assert f"--tensor-model-parallel-size {plan.mesh['tp']}" in command
    assert ("--sequence-parallel" in command) == plan.sequence_parallel
    path = tmp_path / "megatron.sh"
    path.write_text(command)
    again = autopar.plan(graph, devices=64, global_batch=512, constraints=str(path))
    for field in SAME:
        assert getattr(again, field) == getattr(plan, field), field
    if plan.schedule == "interleaved":
        assert again.virtual_stages == plan.virtual_stages


def test_compile_emits_and_reads_a_megatron_command(tmp_path) -> None:
    art = tmp_path / "art"
    made = run_cli("compile", "tiny-llama", "--devices", "8", "--seq", "32", "--global-batch",
                   "8", "--constraints", "tp=2,pp=2,zero_stage=2,sequence_parallel=false",
                   "--emit", "megatron", "--out", str(art), "-q")
    assert made.returncode == 0, made.stderr
    pins = constraints_from_megatron((art / "megatron.sh").read_text())
    assert pins["tp"] == 2 and pins["pp"] == 2 and pins["zero_stage"] == 2
    again = cli_here("compile", "tiny-llama", "--devices", "8", "--seq", "32", "--global-batch",
                    "8", "--constraints", str(art / "megatron.sh"), "--out",
                    str(tmp_path / "again"), "-q")
    assert again.returncode == 0, again.stderr


def test_a_capacity_factor_crosses_to_megatron_and_back() -> None:
    """A plan searched with capacity_factor writes Megatron-Core's capacity flags (dropping in
    sequence order, as autopar's runtime does), and reading those arguments pins the factor
    again."""
    import shlex

    from autopar.plan.megatron import megatron_args

    graph = autopar.capture("tiny-mixtral", seq=32)
    plan = autopar.plan(graph, devices=2, global_batch=4, cluster="a100-80g",
                        constraints=dict(ep=2, capacity_factor=1.25, precision="fp32"))
    args = megatron_args(plan)
    at = args.index("--moe-expert-capacity-factor")
    assert args[at + 1] == "1.25" and "position" in args
    assert constraints_from_megatron(shlex.join(args))["capacity_factor"] == 1.25
    dropless = autopar.plan(graph, devices=2, global_batch=4, cluster="a100-80g",
                            constraints=dict(ep=2, precision="fp32"))
    assert "--moe-expert-capacity-factor" not in megatron_args(dropless)
