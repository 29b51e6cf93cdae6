"""One decoding step of one block: every sequence of a micro-batch adds one token.

A decode step is bound by memory, not arithmetic. Each token reads every weight of the block
once (shared by the micro-batch's sequences) and its own sequence's keys and values from the
cache, for a handful of FLOPs per byte. Per op, on one device::

    time = max(FLOPs / (peak x matmul efficiency), bytes / (bandwidth x memory efficiency))

- **Weights.** A linear reads its weight split as the tensor-parallel layout splits it. An
  embedding reads only the rows of the step's tokens. An expert layer reads the experts its
  tokens are routed to: with ``b`` tokens choosing ``k`` of ``E`` experts uniformly, a device
  holding ``E / ep`` of them reads ``(E / ep)(1 - (1 - k/E)^b)`` on average.
- **The cache.** Attention reads ``context`` positions of keys and values per sequence, split
  by tensor parallelism over the kv heads (replicated when tp exceeds them, so each rank reads
  one head's share). Latent attention (DeepSeek-V2's MLA) reads its cached latent and rotary
  key, whole on every rank, and re-expands them at every step: its up-projection runs over
  the ``context`` positions and the attention reads the expanded keys and values
  (:mod:`autopar.cost.kv_cache`).
- **Skinny matmuls.** A matmul with a few rows runs as a GEMV or split-K kernel that spreads
  the weight over every compute unit, so the tile-and-wave waste of large matmuls
  (:func:`autopar.cost.compute.matmul_efficiency`) does not apply; the weight stream bounds it.
- **Kernels.** Serving programs capture the decode step in a CUDA graph and fuse elementwise
  chains into the matmuls around them (gpt-fast: ``torch.compile(mode="reduce-overhead")``;
  vLLM and TensorRT-LLM run decode under CUDA graphs). A step therefore pays the device's
  per-kernel ramp once per matmul, once per attention and once per fused chain of the
  elementwise ops between them, not once per captured op.
- **Collectives.** Each row-parallel linear all-reduces ``b x hidden`` activations: a few
  kilobytes, so the collective costs its latency (NCCL's LL protocol, priced by
  :mod:`autopar.cost.comm`). Expert parallelism adds a dispatch and a combine all-to-all.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.cost.activations import storage_root
from autopar.cost.block_cost import captured_batch, captured_float_bytes, captured_seq, graph_memo
from autopar.cost.comm import axis_collective_time
from autopar.cost.config import ParallelConfig
from autopar.cost.expert_load import expert_count, top_k
from autopar.cost.hardware import Cluster, DeviceSpec
from autopar.cost.kv_cache import attention_cache_bytes, latent_attention, latent_up_projection
from autopar.cost.tp_layout import cache_split, tp_layout, vocab_parallel
from autopar.ir.graph import Graph, OpKind, OpNode, dtype_bytes

_MATMULS = (OpKind.LINEAR, OpKind.MATMUL)


@dataclass(frozen=True)
class DecodeCost:
    """One block, one decoding step of ``batch`` sequences, one device."""

    compute_s: float  # the ops' roofline times plus their kernels' ramps
    comm_s: float  # tensor/expert-parallel collectives, at their latency
    weight_bytes: float  # weights read
    cache_bytes: float  # keys and values read
    kernels: int


def _param_numel(graph: Graph, op: OpNode) -> int:
    return sum(graph.params[p].numel for p in op.params if p in graph.params)


def block_decode_cost(graph: Graph, index: int, config: ParallelConfig, cluster: Cluster,
                      batch: int, context: int) -> DecodeCost:
    """One decoding step of block ``index`` for ``batch`` sequences whose caches hold
    ``context`` positions, on one device of ``config``; memoised per block type."""
    block = graph.blocks[index]
    layout_key = config.tp_layouts.get(block.type_id) if config.tp_layouts is not None else None
    key = ("decode", block.type_id, batch, context, config.tp, config.ep, config.precision,
           cluster.cache_key, layout_key, config.vocab_parallel)
    memo = graph_memo(graph)
    if key not in memo:
        memo[key] = _block_decode_cost(graph, index, config, cluster, batch, context)
    return memo[key]


def _block_decode_cost(graph: Graph, index: int, config: ParallelConfig, cluster: Cluster,
                       batch: int, context: int) -> DecodeCost:
    device: DeviceSpec = cluster.device  # type: ignore[assignment]
    precision = config.precision
    assert precision is not None, "resolve the precision first"
    block = graph.blocks[index]
    tp = config.tp
    layout = tp_layout(graph, block, config.tp_layouts)
    cap_batch, cap_seq = captured_batch(graph), captured_seq(graph)
    cap_tokens = cap_batch * cap_seq
    act_scale = precision.activation_bytes / captured_float_bytes(graph)
    weight_bytes_each = precision.param_bytes
    peak = device.flops_for(precision.compute)
    bandwidth = device.memory_bandwidth * device.efficiency.memory
    kv_split = cache_split(graph, block, layout, tp)
    compute = 0.0
    weights = cache = 0.0
    kernels = 0
    in_chain = False  # inside a run of elementwise ops that fuse into one kernel
    for name in block.nodes:
        op = graph.op(name)
        if op.kind is OpKind.VIEW:
            continue
        if name in layout.kv:
            divisor = float(layout.kv[name])
        elif (name in layout.column or name in layout.row or name in layout.sharded
              or vocab_parallel(graph, name, tp, config.vocab_parallel)):
            divisor = float(tp)
        else:
            divisor = 1.0
        per_token = batch / cap_tokens
        numel = _param_numel(graph, op)
        weight_read = 0.0
        if op.kind is OpKind.EMBEDDING:
            width = op.output_meta[0].shape[-1] if op.output_meta else 0
            weight_read = batch * width * weight_bytes_each / divisor
        elif op.kind is OpKind.MOE_EXPERT and numel:
            experts = max(expert_count(graph, op), 1)
            k = min(top_k(graph, experts), experts)
            touched = 1.0 - (1.0 - k / experts) ** batch
            weight_read = numel / config.ep * touched * weight_bytes_each
        elif numel:
            weight_read = numel * weight_bytes_each / divisor
        param_captured = sum(graph.params[p].numel * dtype_bytes(graph.params[p].dtype)
                             for p in op.params if p in graph.params)
        moved = max(op.bytes_read + op.bytes_written - param_captured, 0)
        act_bytes = moved * per_token * act_scale / divisor
        flops = op.flops * per_token / divisor
        kv_read = cached = 0.0
        if latent_up_projection(graph, op):
            # latent attention re-expands every cached position's latent into this rank's
            # heads' keys and values at each step (Hugging Face's DeepSeek-V2 attention)
            flops = op.flops / cap_tokens * batch * context / divisor
            act_bytes = (op.output_bytes / cap_tokens * act_scale * batch * context / divisor)
        if op.kind is OpKind.ATTENTION:
            # scores and values over the cache: FLOPs per (query, key) pair from the capture
            pairs = cap_batch * cap_seq * cap_seq
            flops = op.flops / pairs * batch * context / divisor
            sources = (1, 2) if "scaled_dot" in op.target else (1,)
            for i in sources:
                if i >= len(op.inputs):
                    continue
                root = storage_root(graph, op.inputs[i])
                meta = graph.op(root).output_meta[0] if graph.has_op(root) else op.input_meta[i]
                per_position = min(meta.nbytes, op.input_meta[i].nbytes) / cap_tokens
                kv_read += per_position * act_scale * batch * context / kv_split
            if latent_attention(graph, op):
                # the keys and values it reads are the re-expanded ones; the cache read is the
                # latent and the rotary key, whole on every rank
                cached = (attention_cache_bytes(graph, block, op, kv_split) / cap_tokens
                          * act_scale * batch * context)
                kv_read += cached
            else:
                cached = kv_read
            act_bytes = batch * (op.output_meta[0].nbytes / cap_tokens if op.output_meta
                                 else 0) * act_scale / divisor
        nbytes = weight_read + act_bytes + kv_read
        weights += weight_read
        cache += cached
        rate = peak * (device.efficiency.matmul if op.kind in _MATMULS
                       or op.kind is OpKind.MOE_EXPERT else
                       device.efficiency.attention if op.kind is OpKind.ATTENTION
                       else device.efficiency.memory)
        compute += max(flops / rate, nbytes / bandwidth)
        heavy = op.kind in _MATMULS or op.kind in (OpKind.ATTENTION, OpKind.MOE_EXPERT,
                                                   OpKind.EMBEDDING)
        if heavy:
            kernels += 1
            in_chain = False
        elif not in_chain:
            kernels += 1
            in_chain = True
    compute += kernels * device.kernel_overhead_s
    comm = 0.0
    act_bytes_each = precision.activation_bytes
    if tp > 1:
        for name in layout.row:
            op = graph.op(name)
            width = op.output_meta[0].shape[-1] if op.output_meta else 0
            comm += axis_collective_time("all_reduce", batch * width * act_bytes_each, config,
                                         "tp", cluster)
        for name in block.nodes:
            op = graph.op(name)
            if vocab_parallel(graph, name, tp, config.vocab_parallel):  # partial rows summed
                width = op.output_meta[0].shape[-1] if op.output_meta else 0
                comm += axis_collective_time("all_reduce", batch * width * act_bytes_each,
                                             config, "tp", cluster)
            elif name in graph.outputs and name in layout.column:  # split logits gathered
                width = op.output_meta[0].shape[-1] if op.output_meta else 0
                comm += axis_collective_time("all_gather", batch * width * 4, config, "tp",
                                             cluster)
    if config.ep > 1:
        dispatch = [graph.op(n) for n in block.nodes if graph.op(n).kind is OpKind.MOE_EXPERT
                    and "grouped_mm" in graph.op(n).target]
        if dispatch:
            width = dispatch[0].input_meta[0].shape[-1] if dispatch[0].input_meta else 0
            comm += 2 * axis_collective_time("all_to_all", batch * width * act_bytes_each,
                                             config, "ep", cluster)
    return DecodeCost(compute, comm, weights, cache, kernels)


def decode_flops_per_token(graph: Graph) -> float:
    """Forward FLOPs of one token (the captured forward over its tokens)."""
    return graph.flops / max(captured_batch(graph) * captured_seq(graph), 1)


__all__ = ["DecodeCost", "block_decode_cost", "decode_flops_per_token"]
