"""The cost model: (IR, parallel choice, hardware) -> predicted step time and memory per device.

:func:`estimate` picks the training step (priced stage by stage in
:mod:`autopar.cost.stage_cost`) or the serving step (:mod:`autopar.cost.serving`); both build
on stage_cost, so neither imports the other through this module. The stage pieces are named
here too: they are this module's public names since the estimate began."""

from __future__ import annotations

from autopar.cost.block_cost import resolve_precision
from autopar.cost.config import ParallelConfig
from autopar.cost.hardware import Cluster, load_cluster
from autopar.cost.serving import serving_estimate
from autopar.cost.stage_cost import (
    Estimate,
    StageCost,
    balanced_stages,
    combine_stages,
    min_max_partition,
    p2p_hidden_share,
    stage_cost,
    stage_footprint,
    stage_memory,
)
from autopar.ir.graph import Graph


def estimate(graph: Graph, cluster: Cluster | str, config: ParallelConfig,
             task: str = "train") -> Estimate:
    """Predict one optimizer step (train/finetune) or, for infer, one decoding step of every
    concurrent sequence with the prompt's prefill beside it (:mod:`autopar.cost.serving`)."""
    cluster = load_cluster(cluster)
    config = resolve_precision(config, cluster)
    if task == "infer":
        return serving_estimate(graph, cluster, config)
    stages = config.stages or balanced_stages(graph, config.pp)
    stage_costs = [stage_cost(graph, config, cluster, s, blocks, True)
                   for s, blocks in enumerate(stages)]
    return combine_stages(graph, cluster, config, stage_costs, True)


__all__ = ["Estimate", "StageCost", "balanced_stages", "combine_stages", "estimate",
           "min_max_partition",
           "p2p_hidden_share", "stage_cost", "stage_footprint", "stage_memory"]
