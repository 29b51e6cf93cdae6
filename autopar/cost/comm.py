"""Collective times by the alpha-beta model on the links a mesh axis actually uses.

Ring algorithms, with n ranks, message B bytes (the full buffer), per-hop latency alpha and
per-device one-way bandwidth beta:

- all_reduce: 2(n-1) alpha + 2 (n-1)/n B / beta
- all_gather (B = gathered output), reduce_scatter (B = input), all_to_all: (n-1) alpha + (n-1)/n B / beta
- broadcast: ceil(log2 n) alpha + B / beta (pipelined)
- send_recv: alpha + B / beta

An axis whose ranks fit in one node uses the intra-node link; one whose ranks are each on a
different node uses the network; one with k ranks per node on several nodes is hierarchical:
reduce-scatter inside the node, the collective across nodes on B / k, all-gather inside again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from autopar.cost.config import ParallelConfig
from autopar.cost.hardware import Cluster

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast",
               "send_recv")


@dataclass(frozen=True)
class Link:
    bandwidth: float  # bytes/s, one direction, per device
    latency: float  # s


def ring_time(kind: str, nbytes: float, n: int, link: Link) -> float:
    """One flat collective over ``n`` ranks on one kind of link."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    a, bw = link.latency, link.bandwidth
    if kind == "all_reduce":
        return 2 * (n - 1) * a + 2 * (n - 1) / n * nbytes / bw
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) * a + (n - 1) / n * nbytes / bw
    if kind == "broadcast":
        return math.ceil(math.log2(n)) * a + nbytes / bw
    if kind == "send_recv":
        return a + nbytes / bw
    raise ValueError(f"unknown collective {kind!r}; use one of {COLLECTIVES}")


@dataclass(frozen=True)
class AxisPlacement:
    """How the ranks of one mesh-axis group sit on nodes."""

    size: int
    per_node: int  # members of one group inside a node
    nodes: int  # nodes one group spans


def axis_placement(config: ParallelConfig, axis: str, devices_per_node: int) -> AxisPlacement:
    """Members per node of an axis group, with tp innermost, then ep, dp, pp.

    ``dense_dp`` is the ``ep x dp`` group that dense parameters are replicated over.
    """
    if axis == "dense_dp":
        size, stride = config.dp * config.ep, config.tp
    else:
        order = ["tp", "ep", "dp", "pp"]
        size = getattr(config, axis)
        stride = 1
        for inner in order[: order.index(axis)]:
            stride *= getattr(config, inner)
    if stride >= devices_per_node:
        per_node = 1
    else:
        per_node = max(1, min(size, devices_per_node // stride))
    return AxisPlacement(size, per_node, -(-size // per_node))


def intra_link(cluster: Cluster) -> Link:
    eff = cluster.device.efficiency.comm
    return Link(cluster.node.intra_bandwidth * eff, cluster.node.intra_latency)


def inter_link(cluster: Cluster) -> Link:
    eff = cluster.device.efficiency.comm
    return Link(cluster.node.inter_bandwidth * eff, cluster.node.inter_latency)


def collective_time(kind: str, nbytes: float, placement: AxisPlacement, cluster: Cluster) -> float:
    """Time of one collective over an axis group, hierarchical when it spans nodes."""
    n, k, nodes = placement.size, placement.per_node, placement.nodes
    if n <= 1:
        return 0.0
    if nodes <= 1:
        for fit_kind, alpha, beta in cluster.collective_fits:  # measured on this node
            if fit_kind == kind:
                return ring_time(kind, nbytes, n, Link(beta, alpha))
        return ring_time(kind, nbytes, n, intra_link(cluster))
    if k <= 1:
        return ring_time(kind, nbytes, n, inter_link(cluster))
    intra, inter = intra_link(cluster), inter_link(cluster)
    if kind == "all_reduce":
        return (ring_time("reduce_scatter", nbytes, k, intra)
                + ring_time("all_reduce", nbytes / k, nodes, inter)
                + ring_time("all_gather", nbytes, k, intra))
    if kind in ("all_gather", "reduce_scatter"):
        return ring_time(kind, nbytes, k, intra) + ring_time(kind, nbytes / k, nodes, inter)
    if kind == "all_to_all":
        # the (nodes-1)/nodes share of the data crosses the network
        return ring_time(kind, nbytes / nodes, k, intra) + ring_time(kind, nbytes, nodes, inter)
    if kind == "broadcast":
        return ring_time(kind, nbytes, nodes, inter) + ring_time(kind, nbytes, k, intra)
    return ring_time(kind, nbytes, 2, inter)


def axis_collective_time(kind: str, nbytes: float, config: ParallelConfig, axis: str,
                         cluster: Cluster) -> float:
    """Collective over mesh axis ``axis`` ("tp", "ep", "dp", "pp") of ``config``."""
    return collective_time(kind, nbytes, axis_placement(config, axis, cluster.devices_per_node),
                           cluster)


def p2p_time(nbytes: float, config: ParallelConfig, cluster: Cluster) -> float:
    """A pipeline send/recv between neighbouring stages."""
    stride = config.tp * config.ep * config.dp
    link = intra_link(cluster) if stride < cluster.devices_per_node else inter_link(cluster)
    return ring_time("send_recv", nbytes, 2, link)
