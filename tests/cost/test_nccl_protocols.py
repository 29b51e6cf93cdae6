"""NCCL's LL protocol priced with its bandwidth cap (``llMaxBws`` in NCCL's tuning.cc): a
large collective across many nodes cannot ride LL's short per-step latency at half the ring's
bandwidth; it runs LL128 or Simple and pays their latency."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from autopar._paths import data_dir
from autopar.cost.comm import axis_collective_time
from autopar.cost.config import ParallelConfig
from autopar.cost.hardware import load_cluster


def _uncapped(cluster):
    return replace(cluster, node=replace(cluster.node, ll_max_bandwidth=()))


def test_every_shipped_nccl_catalog_states_the_ll_cap() -> None:
    for path in sorted(Path(data_dir("cost_models")).glob("*.yaml")):
        data = yaml.safe_load(path.read_text())
        if data["device"]["backend"] != "nccl":
            continue
        caps = load_cluster(path.stem).node.ll_max_bandwidth
        assert len(caps) == 3 and all(c > 0 for c in caps), path.name
        assert caps[2] <= caps[0], path.name  # across many nodes it never exceeds one node's


@pytest.mark.parametrize("kind", ["all_gather", "reduce_scatter"])
def test_large_collective_across_many_nodes_pays_for_the_ll_cap(kind) -> None:
    cluster = load_cluster("h100-80g")
    config = ParallelConfig(dp=512)  # 64 nodes of 8
    capped = axis_collective_time(kind, 100e6, config, "dp", cluster)
    free = axis_collective_time(kind, 100e6, config, "dp", _uncapped(cluster))
    assert capped > free
    # no protocol moves the bytes faster than the ring's full bus bandwidth
    node = cluster.node
    busbw = min(node.intra_bandwidth * node.intra_efficiency,
                8 * node.inter_bandwidth * node.inter_efficiency)
    assert capped > 511 / 512 * 100e6 / busbw


def test_all_reduce_across_nodes_is_never_cheaper_with_the_cap() -> None:
    """all_reduce may take the double binary tree instead (NCCL picks the fastest)."""
    cluster = load_cluster("h100-80g")
    for dp in (16, 128, 512):
        for nbytes in (1e5, 1e7, 1e9):
            config = ParallelConfig(dp=dp)
            assert axis_collective_time("all_reduce", nbytes, config, "dp", cluster) >= \
                axis_collective_time("all_reduce", nbytes, config, "dp", _uncapped(cluster))


def test_small_collective_keeps_ll() -> None:
    """A few kilobytes take LL's latency whatever its bandwidth cap."""
    cluster = load_cluster("h100-80g")
    config = ParallelConfig(dp=512)
    assert axis_collective_time("all_gather", 4096, config, "dp", cluster) == pytest.approx(
        axis_collective_time("all_gather", 4096, config, "dp", _uncapped(cluster)), rel=1e-3)
