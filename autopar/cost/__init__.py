"""Cost pass: hardware catalog and the time/memory model of a parallel plan."""

from autopar.cost.hardware import Cluster, DeviceSpec, Efficiency, NodeSpec, load_cluster

__all__ = ["Cluster", "DeviceSpec", "Efficiency", "NodeSpec", "load_cluster"]
