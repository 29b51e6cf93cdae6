"""Cost pass: hardware catalog and the time/memory model of a parallel plan."""

from autopar.cost.config import ParallelConfig
from autopar.cost.estimate import Estimate, StageCost, estimate
from autopar.cost.hardware import Cluster, DeviceSpec, Efficiency, NodeSpec, load_cluster
from autopar.cost.memory import MemoryBreakdown

__all__ = ["Cluster", "DeviceSpec", "Efficiency", "Estimate", "MemoryBreakdown", "NodeSpec",
           "ParallelConfig", "StageCost", "estimate", "load_cluster"]
