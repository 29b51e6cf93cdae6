"""The torchrun command that launches a plan: one process per device, nodes as the plan's
cluster has them.

A plan for 64 devices of a cluster with 8 per node runs as 8 nodes of 8 processes, so the
hint is ``torchrun --nnodes 8 --nproc-per-node 8`` plus a rendezvous endpoint that every node
reaches, not ``--nproc-per-node 64`` (which would start 64 processes on one machine). Only
integers from the plan reach the text: a hint may be written into generated code.
"""

from __future__ import annotations

from autopar.cost.hardware import load_cluster

# torchrun's default rendezvous port (the c10d store listens there on the first node)
RENDEZVOUS_PORT = 29500


def devices_per_node(cluster: str) -> int:
    """How many devices one node of ``cluster`` (a plan's ``cluster`` name) holds.

    A cluster that no longer loads (a profile YAML since moved, a renamed catalog entry) is
    taken as one node: the hint is then the single-node one, which is what ran before.
    """
    try:
        loaded = load_cluster(cluster)
    except Exception:  # noqa: BLE001 - a hint never fails the command it decorates
        return 0  # unknown: callers treat 0 as "all devices on one node"
    if loaded.device.type == "cpu":  # CPU "devices" are processes, run on one machine
        return 0
    return int(loaded.devices_per_node or 0)


def node_split(devices: int, per_node: int) -> tuple[int, int]:
    """``(nnodes, nproc_per_node)`` for ``devices`` processes on nodes of ``per_node``.

    torchrun starts the same number of processes on every node, so a world that does not
    fill whole nodes uses the largest divisor of ``devices`` that fits in one node.
    ``per_node`` <= 0 (unknown) puts every process on one node.
    """
    devices = max(1, int(devices))
    if per_node <= 0 or devices <= per_node:
        return 1, devices
    nproc = max(d for d in range(1, per_node + 1) if devices % d == 0)
    return devices // nproc, nproc


def torchrun_launch(devices: int, per_node: int) -> str:
    """``torchrun --nnodes N --nproc-per-node P`` (with a c10d rendezvous when N > 1) for a
    world of ``devices`` on nodes of ``per_node``; ``python`` for one device."""
    if devices <= 1:
        return "python"
    nnodes, nproc = node_split(devices, per_node)
    if nnodes == 1:
        return f"torchrun --nproc-per-node {nproc}"
    return (f"torchrun --nnodes {nnodes} --nproc-per-node {nproc} --rdzv-backend c10d "
            f"--rdzv-endpoint HOST:{RENDEZVOUS_PORT}")


def plan_launch(devices: int, cluster: str) -> str:
    """:func:`torchrun_launch` for a plan of ``devices`` on ``cluster`` (its node size)."""
    return torchrun_launch(devices, devices_per_node(cluster) if devices > 1 else 0)


def on_each_node(launch: str) -> str:
    """A note to follow a multi-node launch: where it runs and what HOST is; empty for one
    node."""
    if "--nnodes" not in launch:
        return ""
    return "on every node; HOST: the first node's address"
