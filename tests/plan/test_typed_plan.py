"""The typed Plan: the model record, its accessors, placement records, and YAML files that
round-trip byte-identically (plans written by the code before the Plan was typed)."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

import autopar
from autopar.cost.precision import FP32, Precision
from autopar.plan import Plan
from autopar.plan.model_facts import BlockFacts, ModelFacts
from autopar.plan.placement import Placement, Shard

# plan.yaml files as autopar wrote them before Plan.model and the placements were typed
# (tiny-llama pp=2 tp=2 on 4 devices, tiny-mixtral ep=2 on 2; seq 64)
FIXTURES = Path(__file__).parent.parent / "fixtures" / "plans"
PLANNED = {
    "tiny_llama_pp2_tp2": dict(model="tiny-llama", devices=4, global_batch=8, seq=64,
                               constraints={"pp": 2, "tp": 2}),
    "tiny_mixtral_ep2": dict(model="tiny-mixtral", devices=2, global_batch=4, seq=64,
                             constraints={"ep": 2}),
}


@pytest.fixture(scope="module")
def planned() -> dict[str, Plan]:
    out = {}
    for name, kw in PLANNED.items():
        kw = dict(kw)
        out[name] = autopar.plan(kw.pop("model"), **kw)
    return out


@pytest.mark.parametrize("name", sorted(PLANNED))
def test_files_written_before_typing_load_and_save_byte_identical(name, tmp_path) -> None:
    before = FIXTURES / f"{name}.yaml"
    again = Plan.load(before).save(tmp_path / "plan.yaml")
    assert again.read_bytes() == before.read_bytes()


@pytest.mark.parametrize("name", sorted(PLANNED))
def test_plans_from_autopar_plan_round_trip_byte_identical(planned, name, tmp_path) -> None:
    first = planned[name].save(tmp_path / "a.yaml")
    second = Plan.load(first).save(tmp_path / "b.yaml")
    assert second.read_bytes() == first.read_bytes()
    # the same request plans what the untyped Plan wrote; the search's own diagnostics
    # (``solver``: candidates pruned, rivals weighed) and the cost model's prices (``predicted``,
    # the rivals in ``alternatives``, the per-block table in ``explain``) change with the
    # search and the cost model, not the format
    assert _without_prices(first.read_text()) == \
        _without_prices((FIXTURES / f"{name}.yaml").read_text())


def _without_prices(text: str) -> str:
    lines, skipping = [], False
    for line in text.splitlines():
        if line and not line[0].isspace() and not line.startswith("- "):  # a top-level key
            skipping = line.startswith(("solver:", "predicted:", "alternatives:", "explain:"))
        if not skipping:
            lines.append(line)
    return "\n".join(lines)


def test_model_is_a_record_that_still_reads_as_the_file_mapping(planned) -> None:
    plan = planned["tiny_llama_pp2_tp2"]
    assert isinstance(plan.model, ModelFacts)
    assert all(isinstance(b, BlockFacts) for b in plan.model.blocks)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.model.params = 1  # type: ignore[misc]
    assert plan.model["inputs"] == {"input_ids": [1, 64]}
    assert plan.model["blocks"][0] == {"name": "head", "type": 0, "kind": "embedding"}
    assert plan.model.get("no such fact", "absent") == "absent"
    assert dict(plan.model) == plan.to_dict()["model"]


def test_facts_an_older_or_newer_file_lacks_or_adds_survive_a_round_trip() -> None:
    given = {"params": 10, "inputs": {"x": [2, 16]},
             "blocks": [{"name": "head", "type": 0}, {"name": "h.0", "type": 1},
                        {"name": "tail", "type": 2, "kind": "output"}],
             "a_later_fact": {"kept": True}}
    facts = ModelFacts.from_dict(given)
    assert facts.to_dict() == given and list(facts.to_dict()) == list(given)
    assert facts.input_dtypes is None and "input_dtypes" not in facts
    assert facts.layers == ["h.0"] and facts.seq == 16


def test_block_roles_layers_and_sequence(planned) -> None:
    plan = planned["tiny_llama_pp2_tp2"]
    assert plan.layers == [f"model.layers.{i}" for i in range(4)]
    roles = {b.name: b.is_layer for b in plan.model.blocks}
    assert roles["head"] is False and roles["tail"] is False and roles["model.layers.2"]
    assert plan.seq == 64
    assert plan.model.block_names[0] == "head" and plan.model.block_names[-1] == "tail"


def test_chunk_ranges_cover_the_blocks_in_order(planned) -> None:
    plan = planned["tiny_llama_pp2_tp2"]
    assert plan.chunk_ranges() == [tuple(s) for s in plan.stages]
    interleaved = dataclasses.replace(plan, schedule="interleaved", virtual_stages=2,
                                      stages=[[0, 4], [4, 6]])
    # rank 0 holds chunks 0 and 2, rank 1 chunks 1 and 3: in model order
    assert interleaved.chunk_ranges() == [(0, 2), (2, 4), (4, 5), (5, 6)]
    with pytest.raises(autopar.PlanError, match="fewer blocks than virtual_stages"):
        dataclasses.replace(plan, schedule="interleaved", virtual_stages=4).chunk_ranges()


@pytest.mark.parametrize("zero,offload,dp,wrapper,zero1", [
    (0, [], 1, "none", False),
    (0, [], 2, "ddp", False),
    (1, [], 2, "ddp", True),
    (2, [], 2, "fully_shard", False),
    (3, [], 2, "fully_shard", False),
    (0, ["optimizer"], 1, "fully_shard", False),
    (1, ["activations"], 2, "ddp", True),
])
def test_data_parallel_wrapper_and_state_offload(planned, zero, offload, dp, wrapper,
                                                 zero1) -> None:
    base = planned["tiny_mixtral_ep2"]
    plan = dataclasses.replace(base, zero_stage=zero, offload=offload,
                               mesh=dict(base.mesh, dp=dp))
    assert plan.data_parallel_wrapper == wrapper
    assert plan.shards_optimizer is zero1
    assert plan.offloads_state is (offload == ["optimizer"])
    assert plan.state_offloads == ([] if offload != ["optimizer"] else ["optimizer"])


def test_precision_record(planned) -> None:
    plan = planned["tiny_llama_pp2_tp2"]
    assert plan.training_precision == Precision.from_dict(plan.precision)
    assert dataclasses.replace(plan, precision={}).training_precision == FP32


def test_world_size_is_checked_in_one_line(planned) -> None:
    plan = planned["tiny_llama_pp2_tp2"]
    plan.check_world_size(4)
    with pytest.raises(autopar.PlanError) as err:
        plan.check_world_size(2)
    message = str(err.value)
    assert "\n" not in message
    assert "the plan is for 4 devices but 2 processes are running" in message
    assert "torchrun --nproc-per-node 4" in message


@pytest.mark.parametrize("text,record", [
    ("Replicate", Placement()),
    ("Shard(0)@tp", Placement((Shard(0, "tp"),))),
    ("Shard(1)@tp+Shard(0)@dp", Placement((Shard(1, "tp"), Shard(0, "dp")))),
    ("Shard(0)@ep", Placement((Shard(0, "ep"),))),
    ("Replicate@tp(kv-heads)", Placement(kv_heads=True)),
])
def test_placement_records_parse_and_print_the_file_form(text, record) -> None:
    assert Placement.parse(text) == record
    assert str(record) == text


def test_placement_record_answers_what_readers_ask() -> None:
    both = Placement.parse("Shard(1)@tp+Shard(0)@dp")
    assert (both.tp_dim, both.dim_over("dp"), both.dim_over("ep")) == (1, 0, None)
    assert both.splits_over_tp
    assert Placement.parse("Replicate@tp(kv-heads)").splits_over_tp
    assert not Placement.parse("Shard(0)@ep").splits_over_tp
    with pytest.raises(autopar.PlanError, match="is not Replicate"):
        Placement.parse("Shard(x)@tp")


def test_param_placements_are_records_of_the_plans_strings(planned) -> None:
    plan = planned["tiny_llama_pp2_tp2"]
    records = plan.param_placements()
    assert set(records) == set(plan.placements["params"])
    assert {fqn: str(p) for fqn, p in records.items()} == plan.placements["params"]
    assert records["model.embed_tokens.weight"].tp_dim == 0


def test_report_is_rendered_by_the_report_package(planned) -> None:
    from autopar.report import render

    plan = planned["tiny_mixtral_ep2"]
    for fmt in ("text", "markdown"):
        assert plan.report(fmt=fmt) == render(plan, fmt)


def test_plan_does_not_import_the_report() -> None:
    plan_dir = Path(autopar.__file__).parent / "plan"
    for source in plan_dir.glob("*.py"):
        for node in ast.walk(ast.parse(source.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n.startswith("autopar.report") for n in names), source.name
