"""Launch hints follow the plan's cluster: nodes of its size, not every process on one node."""

from __future__ import annotations

import pytest

from autopar.plan.launch import devices_per_node, node_split, plan_launch

from .test_inspect import _assert_one_line_error, cli_here

MULTI_NODE = ("torchrun --nnodes 8 --nproc-per-node 8 --rdzv-backend c10d "
              "--rdzv-endpoint HOST:29500")


def test_compile_for_64_devices_hints_8_nodes_of_8(tmp_path, monkeypatch) -> None:
    out = tmp_path / "art"
    done = cli_here("compile", "tiny-llama", "--devices", "64", "--cluster", "h100-80g",
                    "--out", str(out))
    assert done.returncode == 0, done.stderr
    next_line = next(line for line in done.stdout.splitlines() if line.startswith("next:"))
    assert f"{MULTI_NODE} {out}/train.py" in next_line
    assert "--nproc-per-node 64" not in done.stdout
    docstring = (out / "train.py").read_text().split('"""')[1]
    assert f"Run:  {MULTI_NODE} train.py --steps 100" in docstring
    assert "--nproc-per-node 64" not in docstring

    # the same hint when the world is wrong: one plain process for a 64-device plan
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    _assert_one_line_error(cli_here("run", str(out), "--steps", "1"), "64 devices", MULTI_NODE)


def test_a_serving_plan_hints_the_nodes_in_generate_py(tmp_path) -> None:
    out = tmp_path / "serve"
    done = cli_here("compile", "tiny-llama", "--devices", "16", "--cluster", "a100-80g",
                    "--task", "infer", "--out", str(out))
    assert done.returncode == 0, done.stderr
    expected = ("torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d "
                "--rdzv-endpoint HOST:29500")
    assert f"{expected} {out}/generate.py --prompts FILE" in done.stdout
    docstring = (out / "generate.py").read_text().split('"""')[1]
    assert f"Run:  {expected} generate.py --prompts prompts.jsonl" in docstring


def test_one_node_keeps_the_single_node_hint() -> None:
    assert plan_launch(8, "a100-80g") == "torchrun --nproc-per-node 8"
    assert plan_launch(1, "a100-80g") == "python"


@pytest.mark.parametrize(("devices", "per_node", "split"), [
    (64, 8, (8, 8)), (16, 8, (2, 8)), (4, 8, (1, 4)),
    (12, 8, (2, 6)),  # torchrun starts as many on every node: 6 + 6, not 8 + 4
    (7, 4, (7, 1)), (64, 0, (1, 64))])
def test_node_split(devices: int, per_node: int, split: tuple[int, int]) -> None:
    assert node_split(devices, per_node) == split


def test_a_cluster_that_no_longer_loads_is_one_node() -> None:
    assert devices_per_node("a-cluster-since-deleted") == 0
    assert plan_launch(64, "a-cluster-since-deleted") == "torchrun --nproc-per-node 64"
