"""``diff`` names what changed and its effect; ``explain`` shows the choice and alternatives."""

from __future__ import annotations

import pytest

import autopar
from autopar.report.diff import plan_diff, render_diff
from autopar.report.explain import block_explain, node_explain, overview, render_explain


def test_diff_lists_changed_fields_and_their_effect(llama_plan, llama_tp8_plan) -> None:
    d = plan_diff(llama_plan, llama_tp8_plan)
    changed = {c["field"]: (c["a"], c["b"]) for c in d["changes"]}
    assert changed["tp"] == (llama_plan.mesh["tp"], 8)
    if llama_plan.mesh["pp"] != 2:
        assert changed["pp"] == (llama_plan.mesh["pp"], 2)
    else:
        assert "pp" not in changed
    assert changed["constraints"] == ("none", "pp=2, tp=8")
    assert d["placements"]["changed"] > 0
    step = d["effect"][0]
    assert step["metric"] == "step_time_s"
    assert step["delta"] == pytest.approx(llama_tp8_plan.predicted.step_time_s
                                          - llama_plan.predicted.step_time_s)
    assert sum(e["delta"] for e in d["breakdown"]) == pytest.approx(step["delta"], rel=1e-3)
    text = render_diff(d, "a.yaml", "b.yaml")
    assert "slower than A" in text and "tp " in text and "What changed" in text
    md = render_diff(d, "a.yaml", "b.yaml", "markdown")
    assert "| tp | 1 | 8 |" in md


def test_diff_of_a_plan_with_itself_changes_nothing(tiny_plan) -> None:
    d = plan_diff(tiny_plan, tiny_plan)
    assert d["changes"] == [] and d["placements"]["changed"] == 0
    assert d["verdict"].startswith("B is as fast as A and uses the same memory")


def test_explain_block_shows_choice_and_alternatives(llama_tp8_plan) -> None:
    plan = llama_tp8_plan
    d = block_explain(plan, "model.layers.3")
    assert d["block"] == 4 and d["stage"] == 0
    assert d["recompute"] == plan.recompute[4]
    assert set(d["recompute_options"]) == {"none", "selective", "op", "full"}
    full, none = d["recompute_options"]["full"], d["recompute_options"]["none"]
    assert full["activation_bytes"] < none["activation_bytes"] and full["recompute_s"] > 0
    assert set(d["tp_options"]) == {"1", "8"}
    assert d["tp_options"]["8"]["params"] == pytest.approx(d["tp_options"]["1"]["params"] / 8,
                                                           rel=0.01)
    ops = {op["module"]: op for op in d["ops"]}
    q, o = ops["self_attn.q_proj"], ops["self_attn.o_proj"]
    assert q["chosen"] == "column" and o["chosen"] == "row"
    assert {"replicate", "column", "row"} <= set(q)
    # the explanation agrees with the placement the runtime applies
    assert plan.placements["params"]["model.layers.3.self_attn.q_proj.weight"].startswith(
        "Shard(0)@tp")
    assert plan.placements["params"]["model.layers.3.self_attn.o_proj.weight"].startswith(
        "Shard(1)@tp")
    text = render_explain(d)
    assert "column" in text and "replicate" in text and "chosen" in text


def test_explain_node_by_name_module_or_path(llama_tp8_plan) -> None:
    by_path = node_explain(llama_tp8_plan, "mlp.down_proj")
    by_module = node_explain(llama_tp8_plan, "model.layers.7.mlp.down_proj")
    [m] = by_path["matches"]
    assert by_module["matches"] == [m]
    assert node_explain(llama_tp8_plan, m["node"])["matches"][0]["module"] == "mlp.down_proj"
    assert m["chosen"] == "row" and m["row"] < m["replicate"]
    assert by_module["params"] == {"model.layers.7.mlp.down_proj.weight": "Shard(1)@tp"}
    assert "row parallel" in render_explain(by_path)


def test_explain_overview_and_errors(llama_tp8_plan, tiny_plan) -> None:
    d = overview(llama_tp8_plan)
    assert [t["count"] for t in d["block_types"]] == [1, 32, 1]
    assert d["block_types"][1]["strategies"]["column"] == 5  # q, k, v, gate, up
    with pytest.raises(autopar.PlanError, match="no block '99'"):
        block_explain(tiny_plan, "99")
    with pytest.raises(autopar.PlanError, match="no op or module 'nope'"):
        node_explain(tiny_plan, "nope")
