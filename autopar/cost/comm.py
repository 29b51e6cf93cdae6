"""Collective times on the links a mesh axis uses, priced the way NCCL prices them.

A collective over ``n`` ranks, ``k`` of them per node on ``N`` nodes, costs a latency plus its
bytes over the bus bandwidth (nccl-tests' ``busbw``):

- all_reduce: ``lat + 2 (n-1)/n S / busbw``; all_gather (S = gathered output) and
  reduce_scatter (S = input): ``lat + (n-1)/n S / busbw``; broadcast: ``lat + S / busbw``.
- Ring latency (NCCL ``src/graph/tuning.cc``): ``base + (steps - inter_steps) intra_hop +
  inter_steps inter_hop`` with ``steps`` = 2(n-1) for all_reduce and n-1 for all_gather and
  reduce_scatter, of which 2(N-1), resp. N-1, cross the network. It grows linearly with the
  rank count: at thousands of ranks a ring collective costs milliseconds before any byte moves.
- Ring bus bandwidth: the slower of the intra-node link and the group's NICs,
  ``min(intra_bw x intra_eff, k x inter_bw x inter_eff)`` (each device drives its own share of
  the node's network; a group with one member per node gets one share).
- NCCL also runs all_reduce as a double binary tree across nodes (latency
  ``base + 2 ((k-1) intra_hop + log2(N) inter_hop)``, time ``2 S / busbw``, with NCCL's
  per-size tree correction) and in three protocols (LL, LL128, Simple) that trade latency for
  bandwidth; it picks the fastest, and so does this model. LL's bus bandwidth is 1/2 of the
  ring's (1/3.8 of the tree's) and never more than NCCL's ``llMaxBws`` cap
  (``node.ll_max_bandwidth``: by GPU generation in a node, by host CPU across nodes, 20 GB/s
  on three or more Intel-hosted nodes), so large collectives across nodes run LL128 or Simple
  and pay their larger per-step latency. all_gather and reduce_scatter are
  rings on nodes of several GPUs (NCCL's PAT algorithm needs one GPU per node).

The catalog gives the Simple protocol's ring hop latencies (``intra_latency``,
``inter_latency``) and start-up (``collective_latency``); the other protocols and the tree scale
NCCL's own table by them. Backends other than nccl (gloo, hccl) run one ring protocol with the
catalog's numbers. A ``collectives`` fit from `autopar profile` replaces the model inside a node.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from autopar.cost.config import ParallelConfig
from autopar.cost.hardware import Cluster

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast",
               "send_recv")

# NVIDIA/nccl src/graph/tuning.cc at commit 51c58fd6 (post-2.23), microseconds, per protocol
# (LL, LL128, Simple): baseLat and hwLat[NVLINK] / hwLat[NET] of the Ring and Tree algorithms
_NCCL_BASE = {"ring": (6.6, 14.0, 8.4), "tree": (6.8, 14.0, 8.4)}
_NCCL_INTRA = {"ring": (0.6, 1.9, 3.4), "tree": (0.6, 1.25, 4.0)}
_NCCL_INTER = {"ring": (2.7, 4.0, 14.0), "tree": (5.0, 8.5, 14.0)}
# bus bandwidth factors per protocol (same file): ring LL x 1/2, LL128 x 0.92; tree LL x 1/3.8,
# LL128 x 120/128 across nodes, Simple x 0.92
_NCCL_BW = {"ring": (0.5, 0.92, 1.0), "tree": (1 / 3.8, 120 / 128, 0.92)}
# treeCorrectionFactor[protocol][log2(bytes / 64)], 64 B .. 256 MB (same file)
_TREE_CORRECTION = (
    (1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0, 1.0,
     1.0, 1.0, 1.0),
    (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .6, .6, .6, .8, .9, .9, .9, .9,
     1.0, 1.0, 1.0),
    (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7, .8, .9,
     .9, .9),
)
_US = 1e-6


@dataclass(frozen=True)
class Link:
    bandwidth: float  # bytes/s, one direction, per device
    latency: float  # s


def ring_time(kind: str, nbytes: float, n: int, link: Link) -> float:
    """One flat alpha-beta ring over ``n`` ranks on one kind of link (``latency`` per step):
    the form `autopar profile` fits its measurements to."""
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
    """Members per node of an axis group, with tp innermost, then ep, cp, dp, pp.

    ``dense_dp`` is the ``ep x cp x dp`` group that dense parameters are replicated over;
    ``expert_dp`` the ``cp x dp`` group of expert parameters (placed as if its members were
    ``ep x tp`` apart, which they are within a cp group).
    """
    if axis == "dense_dp":
        size, stride = config.dense_replicas, config.tp
    elif axis == "expert_dp":
        size, stride = config.expert_replicas, config.tp * config.ep
    else:
        order = ["tp", "ep", "cp", "dp", "pp"]
        size = getattr(config, axis)
        stride = 1
        for inner in order[: order.index(axis)]:
            stride *= getattr(config, inner)
    if stride >= devices_per_node:
        per_node = 1
    else:
        per_node = max(1, min(size, devices_per_node // stride))
    return AxisPlacement(size, per_node, -(-size // per_node))


def _bus_bandwidth(placement: AxisPlacement, cluster: Cluster) -> float:
    node = cluster.node
    intra = node.intra_bandwidth * node.intra_efficiency
    if placement.nodes <= 1:
        return intra
    network = placement.per_node * node.inter_bandwidth * node.inter_efficiency
    return min(intra, network) if placement.per_node > 1 else network


def _volume(kind: str, nbytes: float, n: int) -> float:
    """Bytes each rank's bus carries, as nccl-tests converts algbw to busbw."""
    if kind == "all_reduce":
        return 2 * (n - 1) / n * nbytes
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n * nbytes
    return nbytes


def _ring_steps(kind: str, n: int, nodes: int) -> tuple[int, int]:
    """(steps, steps that cross the network) of a ring collective (NCCL tuning.cc)."""
    if kind == "all_reduce":
        return 2 * (n - 1), 2 * (nodes - 1)
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return n - 1, nodes - 1
    return n, nodes - 1


def _nccl_time(kind: str, nbytes: float, placement: AxisPlacement, cluster: Cluster) -> float:
    node = cluster.node
    n, k, nodes = placement.size, placement.per_node, placement.nodes
    busbw = _bus_bandwidth(placement, cluster)
    volume = _volume(kind, nbytes, n)
    # the catalog's Simple-protocol numbers scale NCCL's table for the other protocols
    intra_scale = node.intra_latency / (_NCCL_INTRA["ring"][2] * _US)
    inter_scale = node.inter_latency / (_NCCL_INTER["ring"][2] * _US)
    base_scale = node.collective_latency / (_NCCL_BASE["ring"][2] * _US)
    steps, inter_steps = _ring_steps(kind, n, nodes)
    best = float("inf")
    # LL's bus bandwidth is also capped outright (NCCL's llMaxBws): on several nodes it is the
    # slowest protocol for any message past a few hundred kilobytes
    ll_cap = node.ll_cap(nodes)
    for p in range(3):
        lat = (_NCCL_BASE["ring"][p] * base_scale
               + (steps - inter_steps) * _NCCL_INTRA["ring"][p] * intra_scale
               + inter_steps * _NCCL_INTER["ring"][p] * inter_scale) * _US
        bw = busbw * _NCCL_BW["ring"][p]
        best = min(best, lat + volume / (min(bw, ll_cap) if p == 0 else bw))
    if kind == "all_reduce" and nodes > 1:
        index = min(max(int(math.log2(max(nbytes, 64) / 64)), 0), len(_TREE_CORRECTION[0]) - 1)
        for p in range(3):
            lat = (_NCCL_BASE["tree"][p] * base_scale
                   + 2 * ((k - 1) * _NCCL_INTRA["tree"][p] * intra_scale
                          + math.log2(nodes) * _NCCL_INTER["tree"][p] * inter_scale)) * _US
            bw = busbw * _NCCL_BW["tree"][p]
            bw = (min(bw, ll_cap) if p == 0 else bw) * _TREE_CORRECTION[p][index]
            best = min(best, lat + 2 * nbytes / bw)
    return best


def _all_to_all_time(nbytes: float, placement: AxisPlacement, cluster: Cluster) -> float:
    """Every rank sends ``(n-1)/n`` of its ``nbytes`` to the others, one message per peer:
    what leaves the node goes through the sender's own share of the network, the rest over
    the intra-node link; the two run at once."""
    node = cluster.node
    n, k, nodes = placement.size, placement.per_node, placement.nodes
    lat = node.collective_latency + (k - 1) * node.intra_latency + (n - k) * node.inter_latency
    local = nbytes * (k - 1) / n / (node.intra_bandwidth * node.intra_efficiency)
    remote = nbytes * (n - k) / n / (node.inter_bandwidth * node.inter_efficiency) \
        if nodes > 1 else 0.0
    return lat + max(local, remote)


def _plain_ring_time(kind: str, nbytes: float, placement: AxisPlacement,
                     cluster: Cluster) -> float:
    """One ring protocol with the catalog's own step latencies (gloo, hccl)."""
    node = cluster.node
    steps, inter_steps = _ring_steps(kind, placement.size, placement.nodes)
    lat = (node.collective_latency + (steps - inter_steps) * node.intra_latency
           + inter_steps * node.inter_latency)
    return lat + _volume(kind, nbytes, placement.size) / _bus_bandwidth(placement, cluster)


def collective_time(kind: str, nbytes: float, placement: AxisPlacement, cluster: Cluster) -> float:
    """Seconds of one collective of ``nbytes`` over an axis group (see the module docstring)."""
    if kind not in COLLECTIVES:
        raise ValueError(f"unknown collective {kind!r}; use one of {COLLECTIVES}")
    n = placement.size
    if n <= 1 or nbytes <= 0:
        return 0.0
    if placement.nodes <= 1:
        fit = measured_fit(cluster, kind, n)  # measured on this node
        if fit is not None:
            return ring_time(kind, nbytes, n, Link(fit[1], fit[0]))
    if kind == "send_recv":
        return p2p_link_time(nbytes, placement.nodes > 1, cluster)
    launch = cluster.device.kernel_overhead_s  # type: ignore[union-attr]
    if kind == "all_to_all":
        return launch + _all_to_all_time(nbytes, placement, cluster)
    if cluster.device.backend == "nccl":  # type: ignore[union-attr]
        return launch + _nccl_time(kind, nbytes, placement, cluster)
    return launch + _plain_ring_time(kind, nbytes, placement, cluster)


def measured_fit(cluster: Cluster, kind: str, ranks: int) -> tuple[float, float] | None:
    """(alpha, beta) measured on this node for ``kind``: the fit for groups of ``ranks``
    when runs measured one (on cores shared by processes the group size matters beyond the
    ring's steps), else the kind's; None when nothing was measured."""
    fits = {k: (a, b) for k, a, b in cluster.collective_fits}
    return fits.get(f"{kind}@{ranks}") or fits.get(kind)


def p2p_link_time(nbytes: float, across_nodes: bool, cluster: Cluster) -> float:
    """One point-to-point send between two devices, inside a node or across the network."""
    node = cluster.node
    if across_nodes:
        bw, hop = node.inter_bandwidth * node.inter_efficiency, node.inter_latency
    else:
        fit = measured_fit(cluster, "send_recv", 2)
        if fit is not None:
            return fit[0] + nbytes / fit[1]
        bw, hop = node.intra_bandwidth * node.intra_efficiency, node.intra_latency
    return node.collective_latency + hop + nbytes / bw


def axis_collective_time(kind: str, nbytes: float, config: ParallelConfig, axis: str,
                         cluster: Cluster) -> float:
    """Collective over mesh axis ``axis`` ("tp", "ep", "cp", "dp", "pp", "dense_dp",
    "expert_dp") of ``config``."""
    return collective_time(kind, nbytes, axis_placement(config, axis, cluster.devices_per_node),
                           cluster)


def p2p_time(nbytes: float, config: ParallelConfig, cluster: Cluster) -> float:
    """A pipeline send/recv between neighbouring stages."""
    stride = config.tp * config.ep * config.cp * config.dp
    return p2p_link_time(nbytes, stride >= cluster.devices_per_node, cluster)


def _beside(gemm_s: float, comm_s: float, slowdown: float) -> float:
    """A GEMM and a collective issued together: the longer sets the pace, and the GEMM is
    ``slowdown`` slower while the collective runs beside it."""
    return max(gemm_s, comm_s) + slowdown * min(gemm_s, comm_s)


def ring_exchange_wall(gemm_s: float, step_s: float, ranks: int, slowdown: float) -> float:
    """Wall seconds of an all-gather overlapped with the GEMM that consumes it, as a ring
    exchange over ``ranks`` (TransformerEngine's userbuffers): the GEMM starts on the local
    chunk beside the first exchange, each next chunk's GEMM beside the next exchange
    (``step_s`` each, ``ranks - 1`` of them), the last chunk's GEMM alone. What hides is at
    most the GEMM; the collective never hides the GEMM's last chunk."""
    if ranks <= 1 or step_s <= 0:
        return gemm_s
    chunk = gemm_s / ranks
    return (ranks - 1) * _beside(chunk, step_s, slowdown) + chunk


def pipelined_wall(gemm_s: float, chunk_comm_s: float, splits: int, slowdown: float) -> float:
    """Wall seconds of a GEMM whose output is reduce-scattered in ``splits`` chunks
    (``chunk_comm_s`` each): each chunk's reduce-scatter runs beside the next chunk's GEMM;
    the first GEMM chunk runs alone and the last chunk's reduce-scatter is exposed."""
    if splits <= 1:
        return gemm_s + chunk_comm_s
    chunk = gemm_s / splits
    return chunk + (splits - 1) * _beside(chunk, chunk_comm_s, slowdown) + chunk_comm_s


def bulk_wall(gemm_s: float, comm_s: float, slowdown: float) -> float:
    """Wall seconds of a whole collective issued beside an independent GEMM."""
    return _beside(gemm_s, comm_s, slowdown)
