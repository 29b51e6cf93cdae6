"""Serving: the prompt's forward (prefill) and one decoding step of every concurrent sequence.

A serving plan holds ``global_batch`` concurrent sequences whose caches hold up to ``context``
positions (the captured sequence length). Each data-parallel replica serves its share as
``m`` micro-batches of ``microbatch_size`` sequences.

- **Prefill** runs the prompts through the model once, a micro-batch at a time (so only one
  micro-batch's activations are live): the compute-bound forward of the training cost model,
  with the forward's tensor-parallel collectives only, pipelined over the stages as
  ``m T + (sum - T) + (p - 1) p2p`` (T the slowest stage's micro-batch).
- **Decode** adds one token to every sequence (:mod:`autopar.cost.decode`). Without pipeline
  stages, all of a replica's sequences decode in one pass: one read of the weights serves
  them all. With ``p`` stages, one token of a micro-batch crosses every stage in turn,
  handing its hidden state on at each boundary: ``L = sum_i t_i + (p - 1) p2p``; the stages
  work on different micro-batches at once, so a stage needs ``m t_max`` per round. Every
  sequence gets its next token each ``max(L, m t_max)``: the decoding step
  (``decode_s_per_token``), priced with the caches full (``context`` positions), the slowest
  step of a generation.
- **Memory** holds the weights, every sequence's cache and one micro-batch's prefill
  activations; no gradients, no optimizer states.
"""

from __future__ import annotations

from dataclasses import replace

from autopar.cost.block_cost import captured_batch, captured_float_bytes, captured_seq
from autopar.cost.comm import p2p_time
from autopar.cost.config import ParallelConfig
from autopar.cost.decode import block_decode_cost, decode_flops_per_token
from autopar.cost.hardware import Cluster
from autopar.cost.stage_cost import (
    Estimate,
    StageCost,
    balanced_stages,
    min_max_partition,
    stage_cost,
)
from autopar.ir.graph import Graph


def decode_batch(config: ParallelConfig) -> tuple[int, int]:
    """(sequences per decoding pass, passes per step) of one replica. Without pipeline
    stages every sequence of the replica decodes in one pass (one read of the weights); with
    them, the micro-batches take turns on the stages."""
    if config.pp == 1:
        return config.microbatch_size * config.num_microbatches, 1
    return config.microbatch_size, config.num_microbatches


def decode_block_times(graph: Graph, cluster: Cluster, config: ParallelConfig
                       ) -> list[tuple[float, float]]:
    """Per block, (compute, communication) seconds of one decoding pass."""
    batch, _ = decode_batch(config)
    context = captured_seq(graph)
    out = []
    for i in range(len(graph.blocks)):
        c = block_decode_cost(graph, i, config, cluster, batch, context)
        out.append((c.compute_s, c.comm_s))
    return out


def handoff_s(graph: Graph, cluster: Cluster, config: ParallelConfig, index: int) -> float:
    """One decoding pass's hidden states sent on after block ``index``."""
    precision = config.precision
    assert precision is not None
    block = graph.blocks[index]
    tokens = captured_batch(graph) * captured_seq(graph)
    nbytes = block.output_bytes / max(tokens, 1) * decode_batch(config)[0] * (
        precision.activation_bytes / captured_float_bytes(graph))
    return p2p_time(nbytes, config, cluster)


def decode_step(stage_s: list[float], num_microbatches: int, handoffs_s: list[float]
                ) -> tuple[float, float]:
    """(decoding step, idle time of the busiest stage in it): every sequence's next token."""
    latency = sum(stage_s) + sum(handoffs_s)
    busy = num_microbatches * max(stage_s)
    step = max(latency, busy)
    return step, step - busy


def decode_stages(graph: Graph, cluster: Cluster, config: ParallelConfig
                  ) -> tuple[tuple[int, int], ...]:
    """Contiguous stages minimising the slowest stage's decoding time (a decode step reads
    weights, so this balances bytes rather than FLOPs)."""
    times = [a + b for a, b in decode_block_times(graph, cluster, config)]
    return min_max_partition(times, config.pp)


def serving_estimate(graph: Graph, cluster: Cluster, config: ParallelConfig) -> Estimate:
    """Prefill, decoding step and memory of a serving plan (``config`` with its precision)."""
    precision = config.precision
    assert precision is not None, "resolve the precision first"
    stages = config.stages or decode_stages(graph, cluster, config) or \
        balanced_stages(graph, config.pp)
    block_costs: dict = {}
    prefill = [stage_cost(graph, config, cluster, s, blocks, False, None, block_costs)
               for s, blocks in enumerate(stages)]
    per_block = decode_block_times(graph, cluster, config)
    decode_costs = []
    for stage, pre in zip(stages, prefill, strict=True):
        compute = sum(per_block[i][0] for i in range(*stage))
        comm = sum(per_block[i][1] for i in range(*stage))
        # a decoding stage: fwd_s is one decoding pass through the stage
        decode_costs.append(replace(pre, fwd_s=compute + comm, bwd_s=0.0, compute_s=compute,
                                    comm_s=comm, dp_comm_s=0.0, dp_exposed_s=0.0,
                                    weight_grad_s=0.0, dp_microbatch_s=0.0, optimizer_s=0.0))
    handoffs = [handoff_s(graph, cluster, config, end - 1) for _, end in stages[:-1]]
    step, idle = decode_step([s.fwd_s for s in decode_costs], decode_batch(config)[1],
                             handoffs)
    prefill_s = _prefill_time(graph, cluster, config, prefill)
    batch = config.global_batch
    model_flops = decode_flops_per_token(graph) * batch
    peak = cluster.device.flops_for(precision.compute) * config.devices  # type: ignore[union-attr]
    memory = max((s.memory for s in decode_costs), key=lambda mb: mb.total)
    host = max(s.host_bytes for s in decode_costs) * cluster.devices_per_node
    return Estimate(step, idle, decode_costs, memory, model_flops, model_flops / (step * peak),
                    batch / step, 0.0, 0.0, host, precision, prefill_s=prefill_s,
                    context=captured_seq(graph))


def _prefill_time(graph: Graph, cluster: Cluster, config: ParallelConfig,
                  stages: list[StageCost]) -> float:
    """The prompts' forward: ``m`` micro-batches pipelined over the stages."""
    times = [s.fwd_s for s in stages]
    slowest = max(times)
    sends = sum(p2p_time(s.send_bytes, config, cluster) for s in stages[:-1])
    return config.num_microbatches * slowest + (sum(times) - slowest) + sends


__all__ = ["decode_batch", "decode_block_times", "decode_stages", "decode_step", "handoff_s",
           "serving_estimate"]
