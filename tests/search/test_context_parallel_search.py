"""The free search chooses context parallelism (cp) by cost with the other axes, where the
engine that runs the plan runs cp: long sequences get it when memory or time asks for it,
short ones only when it is faster; its lower bounds stay sound; reports and sweeps show it."""

from __future__ import annotations

import importlib
import json
import random
from dataclasses import replace

import click
import pytest

import autopar
from autopar.cost import ParallelConfig, estimate, load_cluster
from autopar.cost.block_cost import resolve_precision
from autopar.cost.context_parallel import all_to_all_ranks
from autopar.report import render
from autopar.search.bounds import candidate_lower_bound, pipelined_work_lower_bound
from autopar.search.space import legal_meshes, model_facts

# autopar.plan is the function; the module holding the runtime's table is imported by name
support = importlib.import_module("autopar.plan.support")


@pytest.fixture
def runtime_runs_cp(monkeypatch):
    """autopar's runtime running cp, as it will once the ring/all-to-all runtime lands (the
    flag's flip): the free search for engine autopar then proposes cp."""
    monkeypatch.setattr(support, "RUNTIME_RUNS_CP", True)


@pytest.fixture(scope="module")
def tiny_long():
    return autopar.capture("tiny-llama", seq=16384)


def test_cp_is_proposed_only_where_the_engine_runs_it(tiny_long, monkeypatch) -> None:
    facts = model_facts(tiny_long)
    monkeypatch.setattr(support, "RUNTIME_RUNS_CP", False)
    assert not support.runtime_runs_cp("autopar")
    assert {m.cp for m in legal_meshes(facts, 8, 8, 8, {}, engine="autopar")} == {1}
    assert not support.runtime_runs_cp("deepspeed")  # its export writes no cp
    # Megatron-Core expresses cp (--context-parallel-size) in every mode it has
    meshes = legal_meshes(facts, 8, 8, 8, {}, engine="megatron-core")
    assert {m.cp for m in meshes} == {1, 2, 4, 8}
    assert {m.cp_mode for m in meshes if m.cp > 1} == {"ring", "alltoall", "allgather"}
    query, kv = max(facts.heads), min(facts.heads)
    for m in meshes:
        a2a = all_to_all_ranks(m.cp, m.cp_mode, m.tp, m.ep, 8)
        # whole heads per all-to-all rank; the sequence in 2 cp chunks for the ring
        assert (query // m.tp) % a2a == 0 and (kv // m.tp) % a2a == 0
        assert facts.seq % (2 * m.cp) == 0 or m.cp_mode == "alltoall"
    # hybrid only where it is neither the ring nor the all-to-all (cp spans nodes)
    hybrid = [m for m in legal_meshes(facts, 8, 8, 2, {}, engine="megatron-core")
              if m.cp_mode == "hybrid"]
    assert hybrid and all(1 < all_to_all_ranks(m.cp, "hybrid", m.tp, m.ep, 2) < m.cp
                          for m in hybrid)
    # pins keep their degree and mode; Llama 3's engine all-gathers only
    assert {(m.cp, m.cp_mode) for m in legal_meshes(facts, 8, 8, 8, {"cp": 4},
                                                    engine="megatron-core")} \
        == {(4, "ring"), (4, "allgather")}  # 4 query / 2 kv heads: no all-to-all over 4
    assert {m.cp_mode for m in legal_meshes(facts, 8, 8, 8, {"cp_mode": "ring"},
                                            engine="megatron-core")} == {"ring"}
    assert {m.cp_mode for m in legal_meshes(facts, 8, 8, 8, {}, engine="llama3-4d")
            if m.cp > 1} == {"allgather"}
    # serving (no engine given) never proposes cp
    assert {m.cp for m in legal_meshes(facts, 8, 8, 8, {})} == {1}


def test_memory_forces_cp_on_a_tiny_model(tiny_long, runtime_runs_cp) -> None:
    # one stage, no tensor parallelism, 50 MB a device: a whole 16k sequence does not fit
    pins, limit = "tp=1,pp=1", 0.05
    with pytest.raises(autopar.InfeasibleError):
        autopar.plan(tiny_long, devices=8, cluster="h100-80g", memory_limit_gb=limit,
                     constraints=f"{pins},cp=1")
    plan = autopar.plan(tiny_long, devices=8, cluster="h100-80g", memory_limit_gb=limit,
                        constraints=pins)
    assert plan.mesh["cp"] > 1
    assert plan.predicted.memory["total"] <= plan.memory_limit_bytes
    text = render(plan, "text")
    assert f"cp={plan.mesh['cp']}" in text and f"{plan.cp_mode} attention" in text
    assert "priced, not run" not in text  # the runtime runs it
    assert "without context parallelism: nothing fits" in text


def test_cp_only_on_models_whose_attention_the_runtime_swaps(runtime_runs_cp) -> None:
    """A model of layers autopar does not know (a plain GPT whose attention the runtime cannot
    swap for the cp attention): the free search keeps cp at 1 even where memory would ask for
    it, and a pinned cp is refused in one line naming the model."""
    from tests.fixtures.plain_models import make_gpt

    model, inputs = make_gpt()
    graph = autopar.capture(model, inputs)
    assert graph.context_parallel_refusal is not None
    assert autopar.capture("tiny-llama", seq=256).context_parallel_refusal is None
    plan = autopar.plan(graph, devices=4, cluster="h100-80g", global_batch=4)
    assert plan.mesh["cp"] == 1
    with pytest.raises(autopar.PlanError, match="cp=2 does not run on this model"):
        autopar.plan(graph, devices=4, cluster="h100-80g", global_batch=4,
                     constraints={"cp": 2})
    # another engine exports cp whatever the model's modules are
    exported = autopar.plan(graph, devices=4, cluster="h100-80g", global_batch=4,
                            constraints={"cp": 2, "engine": "megatron-core"})
    assert exported.mesh["cp"] == 2


def test_cp_competes_with_tp_for_memory(tiny_long, runtime_runs_cp) -> None:
    # free to use tp or pp too: cp is chosen only when it beats the best plan without it
    free = autopar.plan(tiny_long, devices=8, cluster="h100-80g", memory_limit_gb=0.05)
    without = autopar.plan(tiny_long, devices=8, cluster="h100-80g", memory_limit_gb=0.05,
                           constraints="cp=1")
    fastest_without = without.solver["robust"]["fastest_step_time_s"]
    assert free.solver["robust"]["fastest_step_time_s"] <= fastest_without * (1 + 1e-9)
    rival = free.solver["context_parallel"]
    if free.mesh["cp"] > 1:
        assert free.predicted.step_time_s < without.predicted.step_time_s
        assert rival["rival"] == "without"
        # what "why this plan" says of the side without cp holds: its best plan is a real
        # one, or its bound is below every plan without cp
        if rival["best"] is not None:
            assert rival["best"]["step_time_s"] >= fastest_without * (1 - 1e-6)
        else:
            assert rival["least_pruned_bound_s"] <= fastest_without * (1 + 1e-6)
        assert "without context parallelism:" in render(free, "text")
    else:
        assert free.predicted.step_time_s == without.predicted.step_time_s


@pytest.fixture(scope="module")
def llama8b_128k():
    return autopar.capture("llama3-8b", seq=131072)


def test_llama3_8b_at_128k_tokens_uses_cp_and_fits(llama8b_128k, runtime_runs_cp) -> None:
    # autopar compile llama3-8b --devices 64 --cluster h100-80g --seq 131072 (the default
    # global batch: one sequence per device, 8.4 M tokens a step)
    plan = autopar.plan(llama8b_128k, devices=64, cluster="h100-80g")
    assert plan.mesh["cp"] > 1
    assert plan.predicted.memory["total"] <= plan.memory_limit_bytes
    text = render(plan, "text")
    mesh_line = next(x for x in text.splitlines() if x.strip().startswith("mesh"))
    assert f"cp={plan.mesh['cp']}" in mesh_line and plan.cp_mode in mesh_line
    gb = f"{plan.predicted.memory['total'] / 1e9:.3g} GB"
    assert any(x.strip().startswith("memory") and gb in x for x in text.splitlines())
    assert "without context parallelism" in text


@pytest.fixture(scope="module")
def llama8b_8k():
    return autopar.capture("llama3-8b", seq=8192)


def test_llama3_8b_at_8k_tokens_takes_cp_only_if_faster(llama8b_8k, runtime_runs_cp) -> None:
    free = autopar.plan(llama8b_8k, devices=64, cluster="h100-80g")
    without = autopar.plan(llama8b_8k, devices=64, cluster="h100-80g", constraints="cp=1")
    fastest = free.solver["robust"]["fastest_step_time_s"]
    assert fastest <= without.solver["robust"]["fastest_step_time_s"] * (1 + 1e-9)
    assert free.predicted.step_time_s <= without.predicted.step_time_s * (1 + 1e-9)
    if free.mesh["cp"] > 1:  # strictly faster, or the plan without cp is over the risk line
        assert (free.predicted.step_time_s < without.predicted.step_time_s
                or without.predicted.memory["total"] > 0.95 * without.memory_limit_bytes)
    # both sides were weighed, and the report says what the other one lost on
    assert free.solver["context_parallel"]["rival"] in ("with", "without")


@pytest.mark.parametrize("engine", ["autopar", "megatron-core", "llama3-4d"])
def test_lower_bounds_stay_sound_with_cp(tiny_long, engine: str) -> None:
    """Over random cp configurations (every mode, recompute, ZeRO, pipeline), the group bound
    is at most each candidate's bound, which is at most the estimate."""
    graph = autopar.capture("tiny-llama", seq=256)
    facts = model_facts(graph)
    rng = random.Random(7)
    cluster = load_cluster("h100-80g")
    n = len(graph.blocks)
    modes = ("ring", "alltoall", "hybrid", "allgather")
    checked = 0
    while checked < 60:
        cp = rng.choice([2, 4, 8])
        tp = rng.choice([1, 2])
        pp = rng.choice([p for p in (1, 2, 4) if p <= n])
        mode = rng.choice(modes)
        if facts.ulysses_refusal(tp, all_to_all_ranks(cp, mode, tp, 1, 8)):
            continue
        cuts = sorted(rng.sample(range(1, n), pp - 1))
        edges = [0, *cuts, n]
        config = resolve_precision(ParallelConfig(
            dp=rng.choice([1, 2]), tp=tp, pp=pp, cp=cp, cp_mode=mode, engine=engine,
            sequence_parallel=tp > 1 and rng.random() < 0.5, zero_stage=rng.choice([0, 1, 2, 3]),
            microbatch_size=rng.choice([1, 2]), num_microbatches=rng.choice([1, 2, 4]),
            schedule=rng.choice(["1f1b", "zero_bubble"]) if pp > 1 else "1f1b",
            recompute=tuple(rng.choice(["none", "selective", "full"]) for _ in range(n)),
            stages=tuple(zip(edges, edges[1:], strict=False))), cluster)
        est = estimate(graph, cluster, config, "train")
        capacity = max(s.memory.total for s in est.stages)
        bound = candidate_lower_bound(graph, facts, cluster, config, "train", capacity)
        group = pipelined_work_lower_bound(graph, cluster, replace(config, zero_stage=0),
                                           True)
        assert group <= bound * (1 + 1e-9) and bound <= est.step_time_s * (1 + 1e-9), \
            (config, group, bound, est.step_time_s)
        checked += 1


def test_seq_lengths_parse() -> None:
    from autopar.cli.sweep_cmd import parse_seqs

    assert parse_seqs(None, None, "8k..1M") == [8192 * 2 ** i for i in range(8)]
    assert parse_seqs(None, None, "8192,8k,16K") == [8192, 16384]
    assert parse_seqs(None, None, "4096") == [4096]
    for bad in ("8x", "0", "", "1M..8k", "k"):
        with pytest.raises(click.BadParameter):
            parse_seqs(None, None, bad)


def test_sweep_over_sequence_lengths_marks_cp_changes(runtime_runs_cp) -> None:
    from autopar.report.sweep import render_sweep
    from autopar.search.sweep import sweep_seq

    rows = sweep_seq("tiny-llama", [16384, 1024, 4096], devices=8, cluster="h100-80g",
                     memory_limit_gb=0.05, constraints="tp=1,pp=1")
    assert [r.seq for r in rows] == [1024, 4096, 16384]
    assert all(r.plan is not None and r.plan.model["inputs"]["input_ids"][-1] == r.seq
               for r in rows)
    # the short sequences fit whole; the long one splits over cp ranks, and the row says so
    assert rows[0].plan.mesh["cp"] == 1 and rows[-1].plan.mesh["cp"] > 1
    assert any(c["field"] == "cp" for c in rows[-1].changes)
    text = render_sweep(rows, "text")
    assert "Best plan per sequence length" in text and "cp 1 -> " in text
    assert " 16k " in text and f"({rows[-1].plan.cp_mode})" in text


def test_sweep_cli_over_sequence_lengths(tmp_path) -> None:
    from tests.cli.test_inspect import _assert_one_line_error, cli_here

    base = ["sweep", "tiny-llama", "--cluster", "h100-80g", "--constraints",
            "engine=megatron-core,tp=1,pp=1", "--memory-limit-gb", "0.05", "-q"]
    out = tmp_path / "never.json"
    for bad, needle in (("8x", "'8x'"), ("0", "'0'"), ("16k..1k", "16384..1024")):
        _assert_one_line_error(cli_here(*base, "--devices", "8", "--seq", bad, "--out",
                                        str(out)), "--seq", needle)
    _assert_one_line_error(cli_here(*base, "--devices", "4,8", "--seq", "1k,2k"),
                           "one axis at a time")
    assert list(tmp_path.iterdir()) == []
    # Megatron-Core runs cp: the 16k row splits its sequences, and the table says where
    result = cli_here(*base, "--devices", "8", "--seq", "1k,16k", "--format", "json")
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)["rows"]
    assert [r["seq"] for r in rows] == [1024, 16384]
    assert rows[0]["mesh"]["cp"] == 1 and rows[1]["mesh"]["cp"] > 1
    assert {"field": "cp", "before": 1, "after": rows[1]["mesh"]["cp"]} in rows[1]["changes"]
