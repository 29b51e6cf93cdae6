"""The generation program ``autopar compile --task infer`` writes (generate.py): it states the
plan (mesh, layout, stages, cache), and what it generates under gloo on 2 ranks, loaded from
the artifact's own file, equals one process's autopar.Generator on the same seed-0 weights."""

from __future__ import annotations

from pathlib import Path

import pytest

import autopar
from autopar.codegen import compile_artifact, generate_program_text, load_program
from autopar.models.source import describe_source
from tests.fixtures.harness import run_in_group, spawn_ranks

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12], [20, 21, 22], [30, 31, 32, 33, 34]]
NEW = 12


@pytest.fixture(scope="module")
def graph():
    return autopar.capture("tiny-llama", seq=32)


def _plan(graph, devices: int, pins: dict | None):
    return autopar.plan(graph, devices=devices, task="infer", global_batch=4, cluster="cpu",
                        constraints=pins)


def test_the_generation_program_states_the_plan(graph) -> None:
    source = describe_source("tiny-llama")
    one = generate_program_text(_plan(graph, 1, None), source)
    assert "return None  # one device" in one and "init_device_mesh" not in one
    assert "# prefill:" in one and "# decode:" in one and "def generate(" in one
    assert "[batch, kv_heads / tp, max_len, head_dim]" in one
    module = load_program(one)
    assert callable(module.build_mesh) and callable(module.parallelize) and \
        callable(module.generate) and module.build_mesh("cpu") is None

    from tests.fixtures.layouts import with_full_size_layout

    tp = with_full_size_layout(_plan(graph, 2, dict(tp=2, pp=1, dp=1)), "tiny-llama")
    text = generate_program_text(tp, source)
    assert "init_device_mesh(device, (1, 1, 1, 2)" in text
    assert '"self_attn.k_proj": ColumnParallel(' in text  # the planner's split, by layer
    assert "ap.localize_heads(model, SPLIT_HEADS" in text
    assert "kv heads are replicated" in text  # said whenever tp > 1
    assert "per rank: [batch, 1, max_len, 16]" in text  # 2 kv heads over tp=2
    assert "SequenceParallel" not in text  # a decode step has one token to split
    pp = generate_program_text(_plan(graph, 2, dict(pp=2, tp=1, dp=1)), source)
    assert "STAGES = {" in pp and '"model.layers.3": 1' in pp
    assert "split_stages(model, STAGES" in pp and "stage.agree(token)" in pp
    for program in (one, text, pp):
        compile(program, "generate.py", "exec")


def _serve(directories: dict[str, str], prompts: list) -> dict[str, list]:
    """One rank: for each artifact, its own generate.py with its seed-0 weights serving this
    rank's replica's share of the prompts (every rank returns every prompt's new tokens)."""
    from autopar.serve.generate import serve, serving_model

    tokens = {}
    for case, directory in directories.items():
        path = Path(directory) / "generate.py"
        program = load_program(path.read_text(), str(path))
        tokens[case], _ = serve(program, serving_model(directory), prompts,
                                max_new_tokens=NEW)
    return tokens


def _rank(rank: int, port: int, out, world: int, directories: dict, prompts: list) -> None:
    run_in_group(rank, port, out, world, _serve, directories, prompts)


# plans from the search, pinned: tensor parallelism (the planner's full-size layout, so the
# attention and with it the cache split by heads), pipeline stages, and data parallelism (each
# replica serves every other prompt)
CASES = {"tp2": dict(tp=2, pp=1, dp=1), "pp2": dict(pp=2, tp=1, dp=1),
         "dp2": dict(dp=2, tp=1, pp=1)}


@pytest.mark.dist
def test_the_programs_under_gloo_give_one_process_tokens(graph, tmp_path) -> None:
    """The three artifacts are served by the same 2 ranks, one after another (a rank's first
    generation pays seconds of imports)."""
    from autopar.serve.generate import Generator, initial_model, new_tokens
    from tests.fixtures.layouts import with_full_size_layout

    plans, directories = {}, {}
    for case, pins in CASES.items():
        plan = _plan(graph, 2, pins)
        if case == "tp2":
            plan = with_full_size_layout(plan, "tiny-llama")
        art = compile_artifact("tiny-llama", None, plan, tmp_path / case)
        assert (art / "generate.py").is_file() and not (art / "train.py").exists()
        plans[case], directories[case] = plan, str(art)
    (served,) = spawn_ranks(_rank, 2, (2, directories, PROMPTS), timeout_s=180)
    # one process, autopar run's seed-0 weights; data-parallel replicas batch only their
    # shares of the prompts, so these are what one process gets for each share
    generator = Generator(initial_model(describe_source("tiny-llama")))
    for case, plan in plans.items():
        dp = plan.mesh["dp"]
        expected: list = [None] * len(PROMPTS)
        for replica in range(dp):
            share = PROMPTS[replica::dp]
            expected[replica::dp] = new_tokens(generator.generate(share, max_new_tokens=NEW),
                                               share)
        assert served[case] == expected, case
