"""The training program is as long as its plan's story, not as its model is deep: one layer
plan applied in a loop, the recompute rule by block type, the layers and pipeline chunks read
from the plan. Programs the compiler writes for Llama-3 70B and 405B on 64 devices."""

from __future__ import annotations

import pytest

import autopar

pytestmark = pytest.mark.slow

# at most this many lines for Llama-3-70B on 64 devices, global batch 512 (205 when the
# program listed every layer); a deeper model of the same plan shape may add a line or two
# (its recompute rule's exceptions)
MAX_LINES_70B = 80
MORE_LAYERS_SLACK = 2


def _program(name: str, out, **constraints) -> tuple[autopar.Plan, list[str]]:
    """(plan, train.py's lines) of ``name`` compiled for 64 devices, global batch 512: the
    search's best after 10 s (what is measured is the program, not the plan's optimality)."""
    graph = autopar.capture(name, seq=4096)
    plan = autopar.plan(graph, devices=64, global_batch=512, time_limit_s=10,
                        constraints=constraints or None)
    art = autopar.compile(name, None, plan, out)
    return plan, (art / "train.py").read_text().splitlines()


def _shape(plan: autopar.Plan) -> dict:
    """The constraints that pin another model's plan to ``plan``'s shape."""
    m = plan.mesh
    shape = dict(pp=m["pp"], dp=m["dp"], tp=m["tp"], ep=m["ep"], cp=m.get("cp", 1),
                 zero_stage=plan.zero_stage, offload=list(plan.offload),
                 sequence_parallel=plan.sequence_parallel, schedule=plan.schedule)
    if m["pp"] > 1:
        shape["virtual_stages"] = plan.virtual_stages
    return shape


def _assert_depth_free(plan: autopar.Plan, lines: list[str]) -> None:
    text = "\n".join(lines)
    assert f'"{plan.layers[-2]}"' not in text  # no layer listed one by one
    assert "for layer in ap.layers(" in text  # the layers come from the plan, in a loop
    if plan.mesh["tp"] > 1:
        assert "LAYER_STYLES = {" in text  # one layer plan for every layer
    mesh_line = next(line for line in lines if "init_device_mesh(device" in line)
    for axis in ("pp", "dp", "cp", "ep", "tp"):  # the axes in use; no size-1 axis but dp
        # (kept where fully_shard or the dense modules of experts shard over it)
        if plan.mesh.get(axis, 1) > 1:
            assert f'"{axis}"' in mesh_line, mesh_line
        elif axis != "dp":
            assert f'"{axis}"' not in mesh_line, mesh_line


def test_llama3_programs_at_64_devices_do_not_grow_with_the_layers(tmp_path) -> None:
    plan70, lines70 = _program("llama3-70b", tmp_path / "70b")
    assert len(lines70) <= MAX_LINES_70B, "\n".join(lines70)
    _assert_depth_free(plan70, lines70)
    # the 405B's own plan, and the 70B compiled for that plan's shape: as long, give or take
    # the recompute rule
    plan405, lines405 = _program("llama3-405b", tmp_path / "405b")
    same70, same_lines70 = _program("llama3-70b", tmp_path / "70b-as-405b", **_shape(plan405))
    assert _shape(same70) == _shape(plan405)
    assert len(plan405.layers) > len(same70.layers)  # 126 layers against 80
    assert len(lines405) <= len(same_lines70) + MORE_LAYERS_SLACK, "\n".join(lines405)
    _assert_depth_free(plan405, lines405)
