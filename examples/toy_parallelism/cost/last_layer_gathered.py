"""A toy parallelism's cost and capability: keep the last layer's parameters gathered from
its forward to its backward under ZeRO-3, instead of resharding them after the forward and
gathering them again as the backward starts (torchtitan's parallelize_llama does this for its
last block).

Priced on autopar's FSDP model (cost/data_parallel.py): one all-gather of the layer (and its
copy-out) fewer per micro-batch, its gathered parameters held through the loss. An upper
bound: FSDP2 prefetches that gather beside the head's backward, which hides part of it.
"""

from __future__ import annotations

from autopar.cost.block_cost import cached_block_cost, cached_block_traffic, resolve_precision
from autopar.cost.config import ParallelConfig
from autopar.cost.hardware import Cluster
from autopar.ir.graph import Graph


def supported(config: ParallelConfig) -> str | None:
    """Why ``config`` cannot keep its last layer gathered, or None."""
    if config.engine != "autopar" or config.zero_stage != 3:
        return "only ZeRO-3 on autopar's FSDP2 reshards a layer after its forward"
    if config.pp > 1 or config.ep > 1 or config.offload:
        return "pipelines, experts and offload lay their layers out their own way"
    if config.dense_replicas == 1:
        return "one replica: no parameter is gathered"
    return None


def price(graph: Graph, config: ParallelConfig, cluster: Cluster,
          keep: bool) -> tuple[float, float]:
    """(seconds the step gains, bytes the device holds longer) when ``keep``."""
    if not keep or not graph.layer_blocks:
        return 0.0, 0.0
    last = graph.blocks.index(graph.layer_blocks[-1])
    traffic = cached_block_traffic(graph, last, config, cluster)
    params = cached_block_cost(graph, last, config, cluster, "none").dense_params
    param_bytes = resolve_precision(config, cluster).precision.param_bytes
    saved_s = config.num_microbatches * (traffic.gather_s + traffic.gather_copy_s)
    return -saved_s, params * param_bytes
