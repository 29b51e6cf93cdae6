"""Per-block costs: one block's compute, tensor/expert-parallel collectives and memory for one
micro-batch on one device, memoised per block type (repeated layers share one entry), and its
sharded-data-parallel collectives."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, replace

from autopar.cost.activations import block_activation_bytes, forward_peak_bytes
from autopar.cost.comm import (
    axis_collective_time,
    bulk_wall,
    pipelined_wall,
    ring_exchange_wall,
)
from autopar.cost.compute import (
    fp8_cast_seconds,
    is_fused_attention,
    kernel_dtype,
    op_backward_time,
    op_time,
)
from autopar.cost.config import ParallelConfig
from autopar.cost.context_parallel import (
    context_parallel_comm,
    ring_blocks,
    ring_merge_seconds,
)
from autopar.cost.data_parallel import BlockTraffic, block_traffic
from autopar.cost.engines import (
    FUSED_KERNEL_ENGINES,
    UB_BULK_SMS,
    UB_PIPELINE_SMS,
    UB_PIPELINE_SPLITS,
    UB_RING_SMS,
    engine_features,
    sm_share_slowdown,
)
from autopar.cost.expert_load import busiest_rank_load, capped_load, expert_count, top_k
from autopar.cost.fused_regions import fused_region_seconds, fused_regions
from autopar.cost.hardware import Cluster
from autopar.cost.kv_cache import cache_bytes
from autopar.cost.offload import STATE_OFFLOADS
from autopar.cost.precision import Precision, default_precision, fp32_residual_autocast
from autopar.cost.recompute_policy import LAYERLESS_BLOCKS, op_policy_saved
from autopar.cost.tp_layout import (
    attention_core,
    broadcast_inputs,
    cache_split,
    tied_head,
    tp_layout,
    vocab_parallel,
)
from autopar.ir.graph import Block, Graph, OpKind, dtype_bytes
from autopar.peft import is_prefix_param

# Block costs depend on the block's type and a few knobs only; a search asks for the same ones
# thousands of times. Keyed weakly by graph so a dropped graph frees its entries.
_BLOCK_COSTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def graph_memo(graph: Graph) -> dict:
    """This graph's memo of pure functions of it (block costs, balanced splits): keys must
    hold every input the memoised value depends on."""
    return _BLOCK_COSTS.setdefault(graph, {})


@dataclass
class BlockCost:
    """One block, one micro-batch, one device."""

    fwd_s: float
    bwd_s: float
    recompute_s: float
    tp_comm_s: float
    ep_comm_s: float
    activation_bytes: float
    recompute_peak_bytes: float
    kv_cache_bytes: float
    dense_params: float  # elements on this device
    expert_params: float
    output_bytes: float  # what a stage boundary after this block sends
    param_tensors: int = 0  # parameter tensors (one all-gather each under DeepSpeed's ZeRO-3)
    # of dense_params / expert_params, those that train (gradients, optimizer states): fewer
    # than all when fine-tuning freezes the base weights
    trainable_dense: float = 0.0
    trainable_expert: float = 0.0
    # of tp_comm_s, the forward's collectives (all of a forward-only pass's communication)
    tp_fwd_comm_s: float = 0.0
    forward_peak_bytes: float = 0.0  # live at once in a forward without autograd (prefill)
    # context parallelism's attention exchanges (cost.context_parallel), after overlap with
    # attention compute: what they add to the forward and to the backward (incl. recompute)
    cp_fwd_comm_s: float = 0.0
    cp_bwd_comm_s: float = 0.0
    # what the tensor-parallel collectives add to one micro-batch's forward / backward when an
    # engine overlaps them with their GEMMs in chunks (Megatron-Core's --tp-comm-overlap):
    # the exposed part and the GEMMs' slowdown beside them (see tp_overlap_seconds)
    tp_overlap_fwd_s: float = 0.0
    tp_overlap_bwd_s: float = 0.0


def captured_batch(graph: Graph) -> int:
    """The batch size the graph was captured with (its first input's leading dimension)."""
    for inp in graph.inputs:
        if inp.meta.shape:
            return inp.meta.shape[0]
    return 1


def _expert_load(graph: Graph, block: Block, config: ParallelConfig) -> float:
    """The busiest expert-parallel rank's share of a micro-batch's token copies against an
    even share (:func:`autopar.cost.expert_load.busiest_rank_load`); 1.0 without ep or
    experts in the block."""
    if config.ep <= 1:
        return 1.0
    experts = max((expert_count(graph, graph.op(n)) for n in block.nodes
                   if graph.op(n).kind is OpKind.MOE_EXPERT), default=0)
    if not experts:
        return 1.0
    tokens = captured_seq(graph) * config.microbatch_size / config.cp
    k = top_k(graph, experts)
    return capped_load(busiest_rank_load(tokens, k, config.ep), config.capacity_factor,
                       captured_seq(graph), k, experts)


def captured_seq(graph: Graph) -> int:
    """Tokens per sequence the graph was captured with (a serving plan's context)."""
    for inp in graph.inputs:
        if len(inp.meta.shape) > 1:
            return inp.meta.shape[1]
    return 1


def captured_float_bytes(graph: Graph) -> int:
    for p in graph.params.values():
        if p.dtype.startswith(("float", "bfloat")):
            return dtype_bytes(p.dtype)
    return 4


def resolve_precision(config: ParallelConfig, cluster: Cluster) -> ParallelConfig:
    """``config`` with its precision made explicit (the device's default where unset)."""
    if config.precision is not None:
        return config
    return replace(config, precision=default_precision(cluster.device))  # type: ignore[arg-type]


def block_cost(graph: Graph, block: Block, config: ParallelConfig, cluster: Cluster,
               recompute: str) -> BlockCost:
    """Compute, tensor/expert-parallel communication and memory of one block, one micro-batch,
    one device. ``config`` must carry its precision (see :func:`resolve_precision`)."""
    device = cluster.device
    precision = config.precision
    assert precision is not None, "resolve the precision first"
    if recompute == "op" and block.name in LAYERLESS_BLOCKS:
        # torchtitan checkpoints the transformer blocks only, and so does the runtime: the
        # embedding and the head with its loss run as without recompute
        recompute = "none"
    tp, sp = config.tp, config.sequence_parallel and config.tp > 1
    # context parallelism: each rank holds seq / cp tokens of every sequence, so its token-wise
    # compute, activations and activation collectives are 1 / cp of the sequence's; balanced
    # causal chunks give each rank 1 / cp of attention's work too (cost.context_parallel)
    seq_byte_scale = (config.microbatch_size / captured_batch(graph)
                      * precision.activation_bytes / captured_float_bytes(graph))
    flop_scale = config.microbatch_size / captured_batch(graph) / config.cp
    byte_scale = seq_byte_scale / config.cp
    layout = tp_layout(graph, block, config.tp_layouts)
    ring = ring_blocks(config, cluster)  # a cp ring runs attention one key block at a time
    fwd = 0.0
    bwd = 0.0
    core_s = 0.0
    attention_fwd_s = attention_bwd_s = 0.0
    op_s: dict[str, float] = {}  # forward seconds of each op (the GEMMs TP overlap pairs with)
    core = attention_core(graph, block) if recompute == "selective" else set()
    # a tied table and head split together, unless the plan keeps embeddings whole
    tied_split = engine_features(config.engine).tied_vocab_parallel and config.vocab_parallel
    kept = op_policy_saved(graph, block) if recompute == "op" else set()
    expert_param_names: set[str] = set()
    tp_param_names: set[str] = set()
    # a fusing engine runs each region of memory-bound ops as one kernel (cost.fused_regions)
    regions = fused_regions(graph, block) if config.engine in FUSED_KERNEL_ENGINES else []
    fused = {n for region in regions for n in region}
    region_divisor: dict[str, float] = {}
    # ep moves tokens to experts: per-device expert work is one rank's tokens' worth, times
    # how much more the busiest rank receives than an even share (cost.expert_load)
    expert_load = _expert_load(graph, block, config)
    for name in block.nodes:
        op = graph.op(name)
        if op.kind is OpKind.MOE_EXPERT:
            divisor = 1.0 / expert_load
            expert_param_names.update(op.params)
        elif name in layout.kv:  # one kv head of kv per rank; the weights stay whole
            divisor = float(layout.kv[name])
        elif name in layout.column or name in layout.row or name in layout.sharded or sp or \
                tied_head(graph, name, tp, tied_split):
            divisor = float(tp)
        else:
            divisor = 1.0
        if name in layout.column or name in layout.row or vocab_parallel(
                graph, name, tp, config.vocab_parallel, tied_split) or tied_head(
                graph, name, tp, tied_split) or (
                name in layout.sharded and any(is_prefix_param(p) for p in op.params)):
            tp_param_names.update(op.params)
        if name in fused:
            region_divisor.setdefault(name, divisor)
            op_s[name] = 0.0
            continue
        kv_blocks = ring if is_fused_attention(op) else 1
        t = op_time(op, device, precision.compute, flop_scale, byte_scale, divisor,
                    kv_blocks=kv_blocks)
        op_s[name] = t
        fwd += t
        # the backward computes the input gradient and, for an op with a trainable weight,
        # the weight gradient; a frozen weight skips the second
        frozen = bool(op.params) and not any(
            graph.params[p].trainable for p in op.params if p in graph.params)
        t_bwd = op_backward_time(op, device, precision.compute, flop_scale, byte_scale, divisor,
                                 weight_grad=not frozen, kv_blocks=kv_blocks)
        bwd += t_bwd
        if op.kind is OpKind.ATTENTION:
            attention_fwd_s += t
            attention_bwd_s += t_bwd
        if name in core or recompute == "op" and name not in kept:
            core_s += t  # re-run by the backward: each op priced at its own shapes
    for region in regions:
        divisor = max(region_divisor.get(n, 1.0) for n in region)
        region_fwd, region_bwd = fused_region_seconds(graph, block, region, device, byte_scale,
                                                      divisor)
        fwd += region_fwd
        bwd += region_bwd
    if precision.compute == "fp8":
        cast_fwd, cast_bwd = fp8_cast_time(graph, block, layout, tp, flop_scale, cluster)
        fwd += cast_fwd
        bwd += cast_bwd
    kv_split = cache_split(graph, block, layout, tp)
    merge_fwd, merge_bwd = ring_merge_seconds(graph, block, config, cluster, seq_byte_scale,
                                              kv_split)
    fwd += merge_fwd
    bwd += merge_bwd
    if recompute == "selective":  # the re-run attention core merges its ring steps again
        core_s += merge_fwd
    recompute_s = fwd if recompute == "full" else core_s
    # tensor-parallel collectives: forward all-reduce after each row linear, backward all-reduce
    # of each distinct column-linear input (all-gather + reduce-scatter under sequence parallel)
    tp_comm = tp_fwd_comm = 0.0
    if tp > 1:
        kinds = ("all_gather", "reduce_scatter") if sp else ("all_reduce",)
        fwd_bytes = [graph.op(n).output_bytes * byte_scale for n in layout.row]
        heads = [n for n in block.nodes if tied_head(graph, n, tp, tied_split)]
        col_inputs = {graph.op(n).inputs[0]: graph.op(n).input_meta[0].nbytes
                      for n in [*layout.column, *layout.kv, *heads] if graph.op(n).inputs}
        col_inputs.update(broadcast_inputs(graph, block, layout))
        bwd_bytes = [b * byte_scale for b in col_inputs.values()]
        per = [sum(axis_collective_time(k, b, config, "tp", cluster) for k in kinds)
               for b in fwd_bytes + bwd_bytes]
        tp_comm = sum(per)
        tp_fwd_comm = sum(per[: len(fwd_bytes)])
        tp_comm += tp_fwd_comm * recomputed_tp_share(recompute, sp)
    overlap_fwd, overlap_bwd = tp_comm * 0.5, tp_comm * 0.5
    if tp > 1 and sp:
        overlap_fwd, overlap_bwd = tp_overlap_seconds(graph, layout, op_s, byte_scale, config,
                                                      cluster)
        overlap_bwd += overlap_fwd * recomputed_tp_share(recompute, sp)
    ep_comm = 0.0
    if config.ep > 1:
        dispatch = [graph.op(n) for n in block.nodes
                    if graph.op(n).kind is OpKind.MOE_EXPERT and "grouped_mm" in graph.op(n).target]
        if dispatch:
            # dispatch and combine, forward and backward; the busiest receiver sets each
            nbytes = dispatch[0].input_meta[0].nbytes * byte_scale * expert_load
            ep_comm = 4 * axis_collective_time("all_to_all", nbytes, config, "ep", cluster)
    autocast = autocast_compute(config)
    acts = block_activation_bytes(graph, block, tp=tp, sequence_parallel=sp, recompute=recompute,
                                  scale=byte_scale if autocast is None else flop_scale,
                                  layouts=config.tp_layouts, fp8=precision.compute == "fp8",
                                  fused_kernels=config.engine in FUSED_KERNEL_ENGINES,
                                  autocast=autocast)
    kv = cache_bytes(graph, block, kv_split) * byte_scale
    dense = expert = trainable_dense = trainable_expert = 0.0
    for p in block.params:
        info = graph.params.get(p)
        numel = info.numel if info is not None else 0
        trains = info is None or info.trainable
        if p in expert_param_names:
            expert += numel / config.ep
            trainable_expert += numel / config.ep if trains else 0.0
        else:
            share = numel / tp if p in tp_param_names else numel
            dense += share
            trainable_dense += share if trains else 0.0
    # what a stage boundary after this block sends: the sequence shard under sequence
    # parallelism (Megatron), or the whole activation where the engine gathers it first
    sharded_send = sp and not engine_features(config.engine).whole_p2p_under_sp
    out_bytes = block.output_bytes * byte_scale / (tp if sharded_send else 1)
    cp_comm = context_parallel_comm(graph, block, config, cluster, seq_byte_scale, kv_split,
                                    attention_fwd_s, attention_bwd_s, recompute)
    return BlockCost(fwd, bwd, recompute_s, tp_comm, ep_comm, acts.stored_bytes,
                     acts.recompute_peak_bytes, kv, dense, expert, out_bytes, len(block.params),
                     trainable_dense, trainable_expert, tp_fwd_comm,
                     forward_peak_bytes(graph, block, tp, byte_scale, config.tp_layouts,
                                        captured_seq(graph)),
                     cp_comm.fwd_exposed_s, cp_comm.bwd_exposed_s, overlap_fwd, overlap_bwd)


def fp8_cast_time(graph: Graph, block: Block, layout, tp: int, flop_scale: float,
                  cluster: Cluster) -> tuple[float, float]:
    """(forward, backward) seconds of one micro-batch's FP8 casts in a block: each distinct
    input of an FP8 linear once in the forward, each FP8 linear's output gradient once in the
    backward, at the size one tp rank holds (a column-parallel linear reads its whole input and
    writes 1/tp of its output; a row-parallel one the reverse). The weights' casts are left
    out: Transformer Engine keeps the FP8 weights across a step's micro-batches
    (``is_first_microbatch``), so they cost 4 bytes per parameter once a step."""
    device = cluster.device
    inputs: dict[str, float] = {}
    backward = 0.0
    for name in block.nodes:
        op = graph.op(name)
        if kernel_dtype(op, "fp8") != "fp8" or not op.input_meta or not op.output_meta:
            continue
        into = op.input_meta[0].numel * flop_scale / (tp if name in layout.row else 1)
        out = op.output_meta[0].numel * flop_scale / (tp if name in layout.column else 1)
        inputs[op.inputs[0] if op.inputs else name] = into
        backward += fp8_cast_seconds(device, out)
    return sum(fp8_cast_seconds(device, n) for n in inputs.values()), backward


def recomputed_tp_share(recompute: str, sequence_parallel: bool) -> float:
    """The share of a block's forward tensor-parallel collectives that its backward runs again
    when it recomputes. ``full`` re-runs them all. ``op`` keeps the reduce-scatter results
    (torchtitan's policy saves ``reduce_scatter_tensor``) but re-runs the all-gathers in front
    of the column projections (half of the sequence-parallel pair), or, without sequence
    parallelism, the all-reduces after the row projections, whose outputs it does not keep.
    ``selective`` re-runs attention only, between the collectives."""
    if recompute == "full":
        return 1.0
    if recompute == "op":
        return 0.5 if sequence_parallel else 1.0
    return 0.0


def tp_overlap_seconds(graph: Graph, layout, op_s: dict[str, float], byte_scale: float,
                       config: ParallelConfig, cluster: Cluster) -> tuple[float, float]:
    """(forward, backward) seconds a block's sequence-parallel collectives add to its GEMMs
    when they overlap in chunks as TransformerEngine's userbuffers run them (the methods and
    SM counts in :mod:`autopar.cost.engines`). Forward: the all-gather of each column-linear
    input as a ring exchange beside the column GEMMs reading it; the reduce-scatter of each
    row-linear output pipelined in chunks after its GEMM. Backward: the output-gradient
    all-gather of each row linear as a ring exchange beside its dgrad GEMM; the input
    all-gather and the input-gradient reduce-scatter of each column input in bulk beside the
    column dgrad and wgrad GEMMs."""
    tp = config.tp
    units = cluster.device.compute_units
    ring_slow = sm_share_slowdown(UB_RING_SMS, units)
    pipe_slow = sm_share_slowdown(UB_PIPELINE_SMS, units)
    bulk_slow = sm_share_slowdown(UB_BULK_SMS, units)

    def coll(kind: str, nbytes: float) -> float:
        return axis_collective_time(kind, nbytes, config, "tp", cluster)

    fwd = bwd = 0.0
    readers: dict[str, list[str]] = {}
    sizes: dict[str, float] = {}
    for n in [*layout.column, *layout.kv]:
        op = graph.op(n)
        if op.inputs:
            readers.setdefault(op.inputs[0], []).append(n)
            sizes[op.inputs[0]] = op.input_meta[0].nbytes * byte_scale
    for inp, names in readers.items():
        gemm = sum(op_s.get(n, 0.0) for n in names)
        gather = coll("all_gather", sizes[inp])
        fwd += ring_exchange_wall(gemm, gather / (tp - 1), tp, ring_slow) - gemm
        bwd += (bulk_wall(gemm, gather, bulk_slow) - gemm
                + bulk_wall(gemm, coll("reduce_scatter", sizes[inp]), bulk_slow) - gemm)
    for n in layout.row:
        gemm = op_s.get(n, 0.0)
        nbytes = graph.op(n).output_bytes * byte_scale
        chunk = coll("reduce_scatter", nbytes / UB_PIPELINE_SPLITS)
        fwd += pipelined_wall(gemm, chunk, UB_PIPELINE_SPLITS, pipe_slow) - gemm
        bwd += ring_exchange_wall(gemm, coll("all_gather", nbytes) / (tp - 1), tp,
                                  ring_slow) - gemm
    return fwd, bwd


def autocast_compute(config: ParallelConfig, precision: Precision | None = None) -> str | None:
    """The autocast dtype under which autopar's runtime keeps an fp32 residual stream for
    ``config`` (:func:`autopar.cost.precision.fp32_residual_autocast`), or None."""
    replicas = config.dp * config.cp * (config.ep if config.ep > 1 else 1)
    if config.ep > 1:  # experts and dense parameters go to fully_shard together
        sharded = config.zero_stage >= 2 or config.tp > 1
    else:
        sharded = replicas > 1 and config.zero_stage >= 2
    return fp32_residual_autocast(config.engine, precision or config.precision,
                                  replicas_sharded=sharded,
                                  offloads_state=bool(STATE_OFFLOADS & set(config.offload)))


def cached_block_cost(graph: Graph, index: int, config: ParallelConfig, cluster: Cluster,
                      recompute: str) -> BlockCost:
    """:func:`block_cost`, computed once per block type and the knobs it depends on."""
    block = graph.blocks[index]
    layout = config.tp_layouts.get(block.type_id) if config.tp_layouts is not None else None
    features = engine_features(config.engine)
    # the search asks hundreds of thousands of times: the key is built without copying config
    precision = config.precision or default_precision(cluster.device)
    key = (block.type_id, recompute, config.tp, config.sequence_parallel, config.ep,
           config.cp, config.cp_mode, config.microbatch_size, precision, cluster.cache_key, layout,
           config.vocab_parallel, features.tied_vocab_parallel, features.whole_p2p_under_sp,
           config.engine in FUSED_KERNEL_ENGINES, config.capacity_factor,
           autocast_compute(config, precision))
    by_type = graph_memo(graph)
    cost = by_type.get(key)
    if cost is None:
        cost = by_type[key] = block_cost(graph, block, resolve_precision(config, cluster),
                                         cluster, recompute)
    return cost


def cached_block_traffic(graph: Graph, index: int, config: ParallelConfig,
                         cluster: Cluster) -> BlockTraffic:
    """:func:`autopar.cost.data_parallel.block_traffic` of one block, once per block type and
    the knobs it depends on."""
    config = resolve_precision(config, cluster)
    precision = config.precision
    assert precision is not None
    block = graph.blocks[index]
    c = cached_block_cost(graph, index, config, cluster, "none")
    layout = config.tp_layouts.get(block.type_id) if config.tp_layouts is not None else None
    key = ("traffic", block.type_id, config.dp, config.tp, config.ep, config.cp, config.engine,
           precision, cluster.cache_key, layout, config.vocab_parallel)
    by_type = graph_memo(graph)
    if key not in by_type:
        by_type[key] = block_traffic(c.dense_params, c.expert_params, c.param_tensors, config,
                                     cluster, precision.param_bytes, precision.grad_bytes,
                                     c.trainable_dense, c.trainable_expert)
    return by_type[key]
