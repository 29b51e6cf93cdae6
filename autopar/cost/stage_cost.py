"""A training step priced stage by stage: each pipeline stage's time and memory per device
(:func:`stage_cost`), the stages balanced and combined into the step (:func:`combine_stages`),
and the records both return. Shared by the training estimate and the serving one
(:mod:`autopar.cost.serving`); :func:`autopar.cost.estimate.estimate` picks between them."""

from __future__ import annotations

from dataclasses import dataclass, field

from autopar.cost.block_cost import (
    BlockCost,
    cached_block_cost,
    cached_block_traffic,
    captured_batch,
    captured_float_bytes,
    captured_seq,
    graph_memo,
)
from autopar.cost.comm import p2p_time
from autopar.cost.config import ParallelConfig
from autopar.cost.data_parallel import (
    DDP_BUCKET_BYTES,
    BlockTraffic,
    backward_with_collectives,
    forward_with_gathers,
    step_sync,
    step_sync_exposed,
)
from autopar.cost.engines import (
    engine_features,
    fsdp_under_pipeline,
    grads_accumulate_unsharded,
    loss_bytes_per_logit,
    tp_lane,
    zero2_per_microbatch,
)
from autopar.cost.hardware import Cluster
from autopar.cost.memory import (
    MemoryBreakdown,
    inflight_microbatches,
    model_state_bytes,
    offload_transfer,
    optimizer_step_time,
    shards_master_weights,
)
from autopar.cost.pipeline import lone_stage_speedup, pipeline_step_time, shared_pipeline_time
from autopar.cost.precision import Precision, state_bytes
from autopar.ir.graph import Graph


@dataclass
class StageCost:
    blocks: tuple[int, int]  # [start, end)
    fwd_s: float  # one micro-batch, incl. exposed tp/ep and per-micro-batch ZeRO collectives
    bwd_s: float
    compute_s: float  # pure compute of one micro-batch (fwd + bwd + recompute)
    comm_s: float  # tp + ep communication of one micro-batch
    dp_comm_s: float  # data-parallel communication per step, before overlap
    dp_exposed_s: float  # per-step data-parallel time outside the pipelined micro-batches
    memory: MemoryBreakdown = field(default_factory=MemoryBreakdown)
    host_bytes: float = 0.0  # offloaded state held in host memory for this device
    offload_s: float = 0.0  # exposed host-link transfer time per step
    weight_grad_s: float = 0.0  # weight-gradient share of the backward (zero-bubble defers it)
    dp_microbatch_s: float = 0.0  # what per-micro-batch ZeRO collectives add to fwd + bwd
    optimizer_s: float = 0.0  # the optimizer update of this stage's states
    send_bytes: float = 0.0  # what the stage sends to the next one per micro-batch

    @property
    def tail_s(self) -> float:
        """What this stage adds after its last backward: exposed once-per-step data-parallel
        collectives, offload transfers and the optimizer update."""
        return self.dp_exposed_s + self.offload_s + self.optimizer_s


@dataclass
class Estimate:
    step_time_s: float
    bubble_s: float
    stages: list[StageCost]
    memory: MemoryBreakdown  # the most loaded device
    model_flops: float  # per step, without recompute (the MFU numerator)
    mfu: float
    tokens_per_s: float
    optimizer_s: float
    offload_s: float
    host_bytes_per_node: float = 0.0
    precision: Precision | None = None
    # task="infer": step_time_s is one decoding step of every concurrent sequence; the prompt's
    # forward (prefill) and the context the caches hold are these
    prefill_s: float = 0.0
    context: int = 0

    def fits(self, capacity_bytes: float, host_capacity_bytes: float = float("inf")) -> bool:
        """Every device within ``capacity_bytes`` and the offloaded state within host memory."""
        return (all(s.memory.total <= capacity_bytes for s in self.stages)
                and self.host_bytes_per_node <= host_capacity_bytes)


def balanced_stages(graph: Graph, pp: int) -> tuple[tuple[int, int], ...]:
    """Contiguous split of the blocks into ``pp`` stages minimising the largest stage's FLOPs."""
    key = ("balanced", pp)
    memo = graph_memo(graph)
    if key not in memo:
        memo[key] = _balanced_stages(graph, pp)
    return memo[key]


def _balanced_stages(graph: Graph, pp: int) -> tuple[tuple[int, int], ...]:
    n = len(graph.blocks)
    if pp > n:
        raise ValueError(f"pp={pp} exceeds the {n} blocks of the model")
    return min_max_partition([b.flops for b in graph.blocks], pp)


def min_max_partition(times: list[float], parts: int,
                      allowed=None) -> tuple[tuple[int, int], ...]:
    """Contiguous split of ``times`` into ``parts`` ranges minimising the largest sum;
    ``allowed(start, end, part)`` rules ranges out (memory). Empty when none is allowed."""
    n = len(times)
    if parts > n:
        return ()
    prefix = [0.0]
    for t in times:
        prefix.append(prefix[-1] + t)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for j in range(k, n - (parts - k) + 1):
            for i in range(k - 1, j):
                if best[k - 1][i] == inf or (allowed is not None and not allowed(i, j, k - 1)):
                    continue
                v = max(best[k - 1][i], prefix[j] - prefix[i])
                if v < best[k][j]:
                    best[k][j], cut[k][j] = v, i
    if best[parts][n] == inf:
        return ()
    bounds, j = [], n
    for k in range(parts, 0, -1):
        i = cut[k][j]
        bounds.append((i, j))
        j = i
    return tuple(reversed(bounds))


def stage_memory(blocks: list[tuple[BlockCost, int]], config: ParallelConfig, stage: int,
                 train: bool) -> tuple[MemoryBreakdown, float]:
    """Memory of one device of a stage before offload, and the micro-batches it holds.
    ``blocks`` are the stage's distinct block costs with how many blocks have each."""
    precision = config.precision
    assert precision is not None
    mem = MemoryBreakdown()
    dense = sum(c.dense_params * k for c, k in blocks)
    expert = sum(c.expert_params * k for c, k in blocks)
    trainable_dense = sum(c.trainable_dense * k for c, k in blocks)
    trainable_expert = sum(c.trainable_expert * k for c, k in blocks)
    held = 1.0
    if train:
        param_b, grad_b, optim_b, copy_b = state_bytes(precision, config.engine)
        sharded = shards_master_weights(config)
        for numel, n, trains in ((dense, config.dense_replicas, trainable_dense),
                                 (expert, config.expert_replicas, trainable_expert)):
            # frozen weights (fine-tuning) need no fp32 master: held in the param dtype
            states = model_state_bytes(numel, n, 3 if sharded else config.zero_stage, param_b,
                                       grad_b, optim_b, trains,
                                       frozen_param_bytes=precision.param_bytes)
            mem.params += states.params
            # whole until the step's one reduce-scatter where a pipeline schedule defers it
            mem.grads += trains * grad_b if grads_accumulate_unsharded(config) else states.grads
            mem.optimizer += states.optimizer
            # the compute copy of trained weights: kept from the forward to the end of the
            # backward (ZeRO-3 gathers per block, except under a pipeline schedule, whose
            # backwards leave every block gathered)
            if config.zero_stage < 3 or fsdp_under_pipeline(config):
                mem.buffers += trains * copy_b
            if sharded:  # the rest of what fully_shard gathers and keeps until the backward
                mem.buffers += (numel - trains) * precision.param_bytes + (
                    0.0 if copy_b else trains * param_b)
        held = inflight_microbatches(config.schedule, config.pp, stage,
                                     config.num_microbatches, config.virtual_stages)
        on_device = min(held, 1.0) if "activations" in config.offload else held
        mem.activations = (sum(c.activation_bytes * k for c, k in blocks) * on_device
                           + max(c.recompute_peak_bytes for c, _ in blocks))
    else:
        mem.params = (dense + expert) * precision.param_bytes
        # every micro-batch's sequences keep their caches between decoding steps
        mem.kv_cache = sum(c.kv_cache_bytes * k for c, k in blocks) * config.num_microbatches
        mem.activations = max(c.forward_peak_bytes for c, _ in blocks)
    return mem, held


def stage_footprint(graph: Graph, config: ParallelConfig, cluster: Cluster, stage: int,
                    blocks: tuple[int, int], train: bool,
                    modes: tuple[str, ...] | None = None,
                    block_costs: dict | None = None
                    ) -> tuple[list[BlockCost], MemoryBreakdown, float, float]:
    """A stage's blocks' costs, its memory on one device after offload, the bytes it keeps in
    host memory and the offload transfer seconds: what deciding whether it fits needs.

    ``modes`` overrides the config's recompute for the stage's blocks; ``block_costs`` is a
    ``(type_id, mode) -> BlockCost`` memo a caller may share across stages of one config.
    """
    precision = config.precision
    assert precision is not None, "resolve the precision first"
    start, end = blocks
    by_kind: dict[tuple[int, str], BlockCost] = {} if block_costs is None else block_costs
    costs = []
    counts: dict[tuple[int, str], int] = {}
    for i in range(start, end):
        kind = (graph.blocks[i].type_id,
                modes[i - start] if modes is not None else config.recompute_of(i))
        if kind not in by_kind:
            by_kind[kind] = cached_block_cost(graph, i, config, cluster, kind[1])
        costs.append(by_kind[kind])
        counts[kind] = counts.get(kind, 0) + 1
    weighted = [(by_kind[kind], k) for kind, k in counts.items()]
    mem, held = stage_memory(weighted, config, stage, train)
    host_bytes, offload_s = offload_transfer(config, mem, weighted, config.num_microbatches,
                                             cluster, train, held)
    zero = config.zero_stage if train else 0
    if train and zero == 3:
        largest = max(c.dense_params + c.expert_params for c, _ in weighted)
        mem.buffers += 2 * largest * precision.param_bytes  # gathered block + prefetch
    elif train and config.dense_replicas > 1 and zero <= 1:
        mem.buffers += 2 * DDP_BUCKET_BYTES  # two gradient buckets in flight
    if end == len(graph.blocks):  # the logits as the engine's loss holds them
        out = sum(graph.op(n).output_bytes for n in graph.outputs if graph.has_op(n))
        elements = out * config.microbatch_size / captured_batch(graph) / (
            captured_float_bytes(graph) * config.tp * config.cp)
        if train:
            mem.buffers += elements * loss_bytes_per_logit(config.engine,
                                                           precision.activation_bytes)
        else:  # a serving prefill keeps only the last position's logits, in fp32
            mem.buffers += elements * 4 / captured_seq(graph)
    return costs, mem, host_bytes, offload_s


def stage_cost(graph: Graph, config: ParallelConfig, cluster: Cluster, stage: int,
               blocks: tuple[int, int], train: bool, modes: tuple[str, ...] | None = None,
               block_costs: dict | None = None, footprint: tuple | None = None) -> StageCost:
    """One pipeline stage holding ``blocks`` ([start, end)) as stage ``stage`` of the config:
    its per-micro-batch forward and backward (with the tensor/expert-parallel collectives and
    the per-micro-batch ZeRO collectives), its memory, and what it adds to the step after the
    pipelined micro-batches (``tail_s``: once-per-step data-parallel collectives, offload
    transfers and the optimizer update). ``config`` must carry its precision; ``modes`` and
    ``block_costs`` are as in :func:`stage_footprint`; ``footprint`` is what it returned for
    these arguments, when the caller has it already (the search's fit check)."""
    precision = config.precision
    assert precision is not None, "resolve the precision first"
    device = cluster.device
    overlap = device.overlap
    start, end = blocks
    m = config.num_microbatches
    zero = config.zero_stage if train else 0
    costs, mem, host_bytes, offload_s = footprint or stage_footprint(
        graph, config, cluster, stage, blocks, train, modes, block_costs)
    replicated = config.dense_replicas > 1
    # a forward-only pass (prefill) runs the forward's collectives only; an engine that
    # overlaps tp collectives with their GEMMs puts only what is left on the lane; context
    # parallelism's attention exchanges, exposed where attention is shorter
    tp_fwd = [tp_lane(c, config.engine, train)[0] + c.ep_comm_s / 2 + c.cp_fwd_comm_s
              for c in costs]
    tp_bwd = [tp_lane(c, config.engine, train)[1] + c.ep_comm_s / 2 + c.cp_bwd_comm_s
              for c in costs] if train else [0.0] * len(costs)
    compute_fwd = [c.fwd_s for c in costs]
    compute_bwd = [c.bwd_s + c.recompute_s for c in costs] if train else [0.0] * len(costs)
    # data parallelism: per-block collectives inside every micro-batch (ZeRO-3, and ZeRO-2's
    # reduce-scatters on autopar's runtime), or once per step
    gathers = [0.0] * len(costs)
    reduces = [0.0] * len(costs)
    gather_copies = [0.0] * len(costs)  # FSDP2's copies on the compute stream
    reduce_copies = [0.0] * len(costs)
    per_block = train and replicated and (zero == 3 or (zero == 2 and zero2_per_microbatch(config)))
    # FSDP under a pipeline schedule reduce-scatters once per step, after the last backward
    deferred = train and replicated and fsdp_under_pipeline(config)
    if per_block:
        by_type: dict[int, BlockTraffic] = {}
        for i in range(start, end):
            type_id = graph.blocks[i].type_id
            if type_id not in by_type:
                by_type[type_id] = cached_block_traffic(graph, i, config, cluster)
            gathers[i - start] = by_type[type_id].gather_s
            reduces[i - start] = by_type[type_id].reduce_s
            gather_copies[i - start] = by_type[type_id].gather_copy_s
            reduce_copies[i - start] = by_type[type_id].reduce_copy_s if not deferred else 0.0
    lane_fwd = [a + b for a, b in zip(compute_fwd, tp_fwd, strict=True)]
    lane_bwd = [a + b for a, b in zip(compute_bwd, tp_bwd, strict=True)]
    none = [0.0] * len(costs)
    # every micro-batch's forward gathers (ZeRO-2 too: FSDP2 reshards after each backward),
    # except under a pipeline schedule, whose backward leaves them gathered for the next
    fwd_gathers = gathers if per_block and not deferred else none
    # ZeRO-2 keeps the forward's gathers; ZeRO-3 gathers once per micro-batch's backward,
    # under the zero-bubble schedule too: its input step gathers the stage and the weight
    # step that follows finds it gathered (autopar/parallel/split_backward.py)
    bwd_gathers = gathers if zero == 3 else none
    fwd = forward_with_gathers(
        [a + (b if g else 0.0) for a, b, g in zip(lane_fwd, gather_copies, fwd_gathers,
                                                  strict=True)], fwd_gathers, overlap)
    bwd = backward_with_collectives(
        [a + (b if g else 0.0) + c for a, b, g, c in zip(lane_bwd, gather_copies, bwd_gathers,
                                                         reduce_copies, strict=True)],
        bwd_gathers, none if deferred else reduces, overlap) if train else 0.0
    extra = 0.0
    dp_comm = m * (sum(fwd_gathers) + sum(bwd_gathers) + (0.0 if deferred else sum(reduces)))
    if deferred and zero == 3:  # the first micro-batch's forward gathers
        extra += forward_with_gathers(lane_fwd, gathers, overlap) - sum(lane_fwd)
        dp_comm += sum(gathers)
    if train and replicated and (not per_block or deferred):
        sync = step_sync(sum(c.dense_params for c in costs), sum(c.expert_params for c in costs),
                         config, cluster, precision.param_bytes, precision.grad_bytes,
                         sum(c.trainable_dense for c in costs),
                         sum(c.trainable_expert for c in costs), units=len(costs))
        # the window is the plain backward: recompute only lengthens the critical path, and
        # must not look like it buys hiding (it is chosen for memory, never for time)
        extra += step_sync_exposed(sync, sum(c.bwd_s for c in costs) + sum(tp_bwd), overlap,
                                   first_forward_s=sum(lane_fwd))
        dp_comm += sync.grad_s + sync.param_s
    optimizer_s = optimizer_step_time(mem, device, precision) if train else 0.0
    return StageCost(
        blocks=(start, end), fwd_s=fwd, bwd_s=bwd,
        compute_s=sum(compute_fwd) + sum(compute_bwd), comm_s=sum(tp_fwd) + sum(tp_bwd),
        dp_comm_s=dp_comm, dp_exposed_s=extra, memory=mem, host_bytes=host_bytes,
        offload_s=offload_s,
        weight_grad_s=sum(c.bwd_s for c in costs) / 2 if train else 0.0,
        dp_microbatch_s=max(fwd + bwd - sum(lane_fwd) - sum(lane_bwd), 0.0),
        optimizer_s=optimizer_s,
        send_bytes=costs[-1].output_bytes)


def p2p_hidden_share(config: ParallelConfig, cluster: Cluster) -> float:
    """How much of the steady-state pipeline sends hides behind compute: the device's
    concurrent share, except on Megatron-LM's and Megatron-Core's 1F1B, which run the sends
    exposed (Megatron-Core's --overlap-p2p-communication applies to the interleaved schedule
    only)."""
    if not engine_features(config.engine).p2p_overlap_1f1b and config.schedule != "interleaved":
        return 0.0
    return cluster.device.overlap.concurrent


def combine_stages(graph: Graph, cluster: Cluster, config: ParallelConfig,
                   stage_costs: list[StageCost], train: bool) -> Estimate:
    """The step from its stages: the pipelined micro-batches, then the slowest stage's tail."""
    precision = config.precision
    assert precision is not None
    device = cluster.device
    m = config.num_microbatches
    p2p = max((p2p_time(s.send_bytes, config, cluster) for s in stage_costs[:-1]), default=0.0)
    schedule = dict(schedule=config.schedule, virtual_stages=config.virtual_stages,
                    p2p_s=p2p, weight_grad_s=[s.weight_grad_s for s in stage_costs],
                    p2p_hidden=p2p_hidden_share(config, cluster),
                    p2p_slowdown=device.overlap.compute_slowdown)
    fwd, bwd = [s.fwd_s for s in stage_costs], [s.bwd_s for s in stage_costs]
    speedup = lone_stage_speedup(config, cluster)
    if speedup > 1:  # stages time-share the node's cores: a lone one computes faster
        step, bubble = shared_pipeline_time(fwd, bwd, m, speedup, **schedule)
    else:
        step, bubble = pipeline_step_time(fwd, bwd, m, **schedule)
    step += max(s.tail_s for s in stage_costs)
    optimizer_s = max(s.optimizer_s for s in stage_costs)
    offload_s = max(s.offload_s for s in stage_costs)
    batch = config.global_batch
    tokens = batch * max(graph.tokens // captured_batch(graph), 1)
    model_flops = graph.flops * batch / captured_batch(graph) * (3 if train else 1)
    peak = device.flops_for(precision.compute) * config.devices
    memory = max((s.memory for s in stage_costs), key=lambda mb: mb.total)
    host = max(s.host_bytes for s in stage_costs) * cluster.devices_per_node
    return Estimate(step, bubble, stage_costs, memory, model_flops, model_flops / (step * peak),
                    tokens / step, optimizer_s, offload_s, host, precision)


__all__ = ["Estimate", "StageCost", "balanced_stages", "combine_stages",
           "min_max_partition",
           "p2p_hidden_share", "stage_cost", "stage_footprint", "stage_memory"]
