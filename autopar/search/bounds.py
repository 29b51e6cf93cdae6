"""Lower bounds on a candidate's step time and memory, built from the cost model's own
functions so that none can exceed what the estimate says (tests/search/test_bounds.py checks
1,200 random configurations). The planner orders candidates by them and stops when the next one
cannot beat the best plan found."""

from __future__ import annotations

from functools import lru_cache

from autopar.cost.block_cost import cached_block_cost, cached_block_traffic
from autopar.cost.comm import p2p_time
from autopar.cost.config import ParallelConfig
from autopar.cost.data_parallel import overlapped, step_sync, step_sync_exposed
from autopar.cost.engines import fsdp_under_pipeline, tp_lane, zero2_per_microbatch
from autopar.cost.estimate import p2p_hidden_share
from autopar.cost.hardware import Cluster
from autopar.cost.memory import (
    MemoryBreakdown,
    fully_sharded_states,
    host_states,
    inflight_microbatches,
    model_state_bytes,
    offload_transfer,
    optimizer_step_time,
    shards_master_weights,
)
from autopar.cost.pipeline import fill_drain_factor, lone_stage_speedup
from autopar.cost.precision import state_bytes
from autopar.ir.graph import Graph
from autopar.search.recompute import MODES
from autopar.search.space import ModelFacts


def _recompute_lower_bound(graph: Graph, facts: ModelFacts, cluster: Cluster,
                           config: ParallelConfig, train: bool, capacity: float,
                           pinned: str | tuple[str, ...] | None) -> float:
    """Recompute seconds per micro-batch, summed over all blocks, that any plan of this
    candidate needs to fit ``capacity``.

    Stage s holds at least its states plus its stored activations times the micro-batches it
    keeps; summed over stages that caps the activations all stages can store, and the rest of
    what no recompute would store must be shed. Every block type offers none -> selective ->
    op -> full steps (bytes saved, seconds spent); the lower convex hull of those steps, filled
    greedily (the LP relaxation of the per-block choice), costs no more than any real choice.
    """
    if not train:
        return 0.0
    if isinstance(pinned, tuple):
        return sum(cached_block_cost(graph, i, config, cluster, mode).recompute_s
                   for i, mode in enumerate(pinned))
    if pinned is not None:
        return sum(len(blocks) * cached_block_cost(graph, blocks[0].index, config, cluster,
                                                   pinned).recompute_s
                   for blocks in graph.block_types().values())
    floor = _offloaded_floor(graph, facts, config, train)
    held = [inflight_microbatches(config.schedule, config.pp, s, config.num_microbatches,
                                  config.virtual_stages) for s in range(config.pp)]
    if "activations" in config.offload:
        held = [min(h, 1.0) for h in held]
    types = [(blocks[0].index, len(blocks)) for blocks in graph.block_types().values()]
    plain = [cached_block_cost(graph, i, config, cluster, "none") for i, _ in types]
    acts = sum(c.activation_bytes * count for c, (_, count) in zip(plain, types, strict=True))
    # stage s keeps held_s micro-batches: its activations are at most (capacity - its states)
    # / held_s; summed over stages, with the states (pp x the floor) placed where they cost
    # the least room, the stages keep at most capacity x sum(1 / held_s) - pp x floor / max(held)
    states = floor.params + floor.grads + floor.optimizer
    room = capacity * sum(1.0 / h for h in held) - config.pp * states / max(held)
    need = acts - room
    if need <= 0:
        return 0.0
    stored = {mode: [cached_block_cost(graph, i, config, cluster, mode) for i, _ in types]
              for mode in MODES}
    steps: list[tuple[float, float]] = []  # (seconds per byte, bytes) of every hull step
    for t, (_, count) in enumerate(types):
        points = [(0.0, 0.0)] + [
            (stored["none"][t].activation_bytes - stored[mode][t].activation_bytes,
             stored[mode][t].recompute_s) for mode in MODES if mode != "none"]
        hull = [(0.0, 0.0)]
        for saved, seconds in sorted(points[1:]):
            if saved <= hull[-1][0]:
                continue
            while len(hull) >= 2:
                (a0, t0), (a1, t1) = hull[-2], hull[-1]
                if (t1 - t0) * (saved - a0) >= (seconds - t0) * (a1 - a0):
                    hull.pop()  # not on the lower hull
                else:
                    break
            hull.append((saved, seconds))
        for (a0, t0), (a1, t1) in zip(hull, hull[1:], strict=False):
            steps.append(((t1 - t0) / (a1 - a0), (a1 - a0) * count))
    seconds = 0.0
    for rate, nbytes in sorted(steps):
        take = min(nbytes, need)
        seconds += rate * take
        need -= take
        if need <= 0:
            break
    return seconds


def _lane_seconds(c, config: ParallelConfig, train: bool) -> tuple[float, float]:
    """(forward, backward) seconds block cost ``c`` (no recompute) puts on its stage's
    compute lane per micro-batch: compute, and the tensor-, expert- and context-parallel
    collectives the estimate's ``stage_cost`` adds to it."""
    tp_f, tp_b = tp_lane(c, config.engine, True) if train else (c.tp_comm_s, 0.0)
    forward = c.fwd_s + tp_f + c.ep_comm_s / 2 + c.cp_fwd_comm_s
    if not train:
        return forward, 0.0
    return forward, c.bwd_s + tp_b + c.ep_comm_s / 2 + c.cp_bwd_comm_s


def pipelined_work_lower_bound(graph: Graph, cluster: Cluster, config: ParallelConfig,
                               train: bool) -> float:
    """No candidate that shares ``config``'s mesh, micro-batching, sequence parallelism and
    layouts (any ZeRO stage, schedule, offload, recompute or stage partition: none of them
    changes a block's cost) has a shorter step: m micro-batches of the blocks' lane seconds
    spread perfectly over the pp stages. Every branch of :func:`_lower_bound` is at least
    this (data-parallel collectives only lengthen a pass: ``overlapped(x, y) >= x``), so the
    search may order and prune whole groups of candidates by it before pricing their knobs."""
    work = 0.0
    for blocks in graph.block_types().values():
        c = cached_block_cost(graph, blocks[0].index, config, cluster, "none")
        work += len(blocks) * sum(_lane_seconds(c, config, train))
    return config.num_microbatches * work / config.pp


def _lower_bound(graph: Graph, cluster: Cluster, config: ParallelConfig, train: bool,
                 schedule: str = "1f1b", virtual_stages: int = 1,
                 recompute_s: float = 0.0) -> float:
    """No step can be faster: the work of one micro-batch, W, split evenly over p stages, run
    m times, plus the schedule's fill and drain on the even split, (p - 1) W / p x phi
    (:func:`autopar.cost.pipeline.fill_drain_factor`); ``recompute_s`` is a lower bound on the
    recompute memory forces (:func:`_recompute_lower_bound`). With stage times t_i summing to at
    least W the step is at least m max(t) + (sum(t) - max(t)) phi, smallest at max(t) = W / p;
    collectives and recompute only add to it. Per-micro-batch sharded-data-parallel
    collectives beside a pass cost at least ``overlapped(pass compute, collectives)``: the
    overlap formula is homogeneous and concave in the collectives, so the sum over blocks and
    stages is at least the formula on the sums."""
    weight_grad = 0.0
    compute_f = compute_b = gather = reduce = 0.0
    replicated = train and config.dense_replicas > 1
    zero3 = replicated and config.zero_stage == 3
    reduces = zero3 or (replicated and config.zero_stage == 2 and zero2_per_microbatch(config))
    # FSDP under a pipeline schedule: no per-micro-batch reduce-scatter nor forward gather
    deferred = replicated and fsdp_under_pipeline(config)
    per_type: dict[int, float] = {}
    smallest_send = float("inf")
    for blocks in graph.block_types().values():
        i, count = blocks[0].index, len(blocks)
        c = cached_block_cost(graph, i, config, cluster, "none")
        # the tp collectives a block puts on its lane (as the estimate's stage_cost does)
        tp_f, tp_b = tp_lane(c, config.engine, True) if train else (c.tp_comm_s / 2,
                                                                    c.tp_comm_s / 2)
        # what a block puts on its stage's compute lane (as the estimate's stage_cost does)
        # context parallelism's exposed exchanges sit on the same lane (least without
        # recompute: a recomputed attention exchanges again)
        cp_f, cp_b = c.cp_fwd_comm_s, (c.cp_bwd_comm_s if train else 0.0)
        per_type[blocks[0].type_id] = c.fwd_s + tp_f + tp_b + cp_f + cp_b + (
            c.bwd_s + c.ep_comm_s if train else c.ep_comm_s / 2)
        smallest_send = min(smallest_send, c.output_bytes)
        weight_grad += count * c.bwd_s / 2 if train else 0.0
        lane_f, lane_b = _lane_seconds(c, config, train)
        compute_f += count * lane_f
        compute_b += count * lane_b
        if reduces:
            traffic = cached_block_traffic(graph, i, config, cluster)
            gather += count * traffic.gather_s if zero3 else 0.0
            reduce += count * traffic.reduce_s
    overlap = cluster.device.overlap
    if deferred:
        reduce = 0.0
    total = overlapped(compute_f, 0.0 if deferred else gather, overlap)
    if train:
        total += overlapped(compute_b + recompute_s, gather + reduce, overlap)
    p, m = config.pp, config.num_microbatches
    phi = fill_drain_factor(schedule, virtual_stages, total, weight_grad,
                            config.num_microbatches, config.pp)
    if p == 1:
        return m * total
    # the slowest stage is at least the average, and at least the best any contiguous split
    # of the blocks' own times achieves
    times = tuple(per_type[b.type_id] for b in graph.blocks)
    bottleneck = max(total / p, _min_max_split(times, p))
    chunks = virtual_stages if schedule == "interleaved" else 1
    send = p2p_time(smallest_send, config, cluster)
    hidden = p2p_hidden_share(config, cluster)
    sends = 2 * (p * chunks - 1) * send + 2 * chunks * m * send * (
        (1 - hidden) + hidden * cluster.device.overlap.compute_slowdown)
    speedup = lone_stage_speedup(config, cluster)
    if speedup > 1:  # shared compute slots: the faster chain, or the node's work over them
        return max((m * bottleneck + phi * (total - bottleneck)) / speedup + sends,
                   m * total / p)
    return m * bottleneck + phi * (total - bottleneck) + sends


@lru_cache(maxsize=4096)
def _min_max_split(times: tuple[float, ...], parts: int) -> float:
    """A lower bound (within 1e-9) on the slowest part of the best split of ``times`` into at
    most ``parts`` contiguous parts: bisection on the greedy packing test."""
    lo, hi = max(times), sum(times)
    if parts <= 1 or lo >= hi:
        return hi if parts <= 1 else lo
    for _ in range(60):
        mid = (lo + hi) / 2
        count, run = 1, 0.0
        for t in times:
            if run + t > mid:
                count, run = count + 1, t
            else:
                run += t
        if count <= parts:
            hi = mid
        else:
            lo = mid
        if hi - lo <= 1e-9 * hi:
            break
    return lo


def _states_floor(graph: Graph, facts: ModelFacts, config: ParallelConfig, train: bool
                  ) -> MemoryBreakdown:
    """Parameter, gradient and optimizer bytes that some device holds at least: the model states
    split as evenly as the mesh allows, before offload (the cost model's ZeRO formula)."""
    precision = config.precision
    assert precision is not None
    dense = (graph.num_params - facts.expert_params) / (config.tp * config.pp)
    experts = facts.expert_params / (config.ep * config.pp)
    # the trainable share, split as far as anything is (a lower bound)
    trains_dense = (facts.trainable_params - facts.trainable_expert_params) / (
        config.tp * config.pp)
    trains_experts = facts.trainable_expert_params / (config.ep * config.pp)
    out = MemoryBreakdown()
    param_b, grad_b, optim_b, _ = state_bytes(precision, config.engine)
    for numel, replicas, trains in ((dense, config.dense_replicas, trains_dense),
                                    (experts, config.expert_replicas, trains_experts)):
        if train:
            zero = 3 if shards_master_weights(config) else config.zero_stage
            states = model_state_bytes(numel, replicas, zero, param_b, grad_b, optim_b, trains,
                                       frozen_param_bytes=precision.param_bytes)
        else:
            states = MemoryBreakdown(params=numel * precision.param_bytes)
        out.params += states.params
        out.grads += states.grads
        out.optimizer += states.optimizer
    return out


def _offloaded_floor(graph: Graph, facts: ModelFacts, config: ParallelConfig, train: bool
                     ) -> MemoryBreakdown:
    """The states floor less the states the offload keeps on the host (the cost model's
    :func:`host_states`)."""
    floor = _states_floor(graph, facts, config, train)
    for state in host_states(config.offload, config.engine, train):
        setattr(floor, state, 0.0)
    return floor


def candidate_lower_bound(graph: Graph, facts: ModelFacts, cluster: Cluster,
                          config: ParallelConfig, task: str, capacity: float,
                          pinned_recompute: str | tuple[str, ...] | None = None) -> float:
    """No plan of this candidate (any stage partition, any per-block recompute that fits
    ``capacity``) has a shorter step: the pipelined work with the least recompute memory
    forces, plus the optimizer update and offload streams of the least any device holds.
    ``config`` must carry its precision."""
    train = task != "infer"
    recompute = _recompute_lower_bound(graph, facts, cluster, config, train, capacity,
                                       pinned_recompute)
    return (_lower_bound(graph, cluster, config, train, config.schedule, config.virtual_stages,
                         recompute)
            + _update_time_lower_bound(graph, facts, cluster, config, train))


def memory_lower_bound(graph: Graph, facts: ModelFacts, cluster: Cluster,
                       config: ParallelConfig, train: bool) -> float:
    """No device of this candidate needs less: the states floor (less what is offloaded) plus a
    1/pp share of the activations every block keeps even under full recompute."""
    floor = _offloaded_floor(graph, facts, config, train)
    total = floor.params + floor.grads + floor.optimizer
    if train:
        lean = sum(len(blocks) * cached_block_cost(graph, blocks[0].index, config, cluster,
                                                   "full").activation_bytes
                   for blocks in graph.block_types().values())
        total += lean / config.pp
    return total


def host_lower_bound(graph: Graph, facts: ModelFacts, cluster: Cluster,
                     config: ParallelConfig, train: bool) -> float:
    """No node of this candidate keeps less in host memory: the offloaded share of the states
    floor (as :func:`offload_transfer` keeps it) for each of the node's devices. Checked before
    any partition is priced, so a model whose states no host can take is refused at once."""
    states = host_states(config.offload, config.engine, train)
    if not states:
        return 0.0
    floor = _states_floor(graph, facts, config, train)
    if train and config.engine == "autopar":
        floor = fully_sharded_states(config, floor, [])
    return sum(getattr(floor, state) for state in states) * cluster.devices_per_node


def _update_time_lower_bound(graph: Graph, facts: ModelFacts, cluster: Cluster,
                             config: ParallelConfig, train: bool) -> float:
    """The optimizer update, the optimizer/parameter offload streams and the once-per-step
    data-parallel collectives of the least any device holds (the cost model's own functions
    on the states floor)."""
    if not train:
        return 0.0
    floor = _states_floor(graph, facts, config, train)
    _, offload_s = offload_transfer(config, floor, [], config.num_microbatches, cluster,
                                    train, 1.0)
    seconds = offload_s + optimizer_step_time(floor, cluster.device, config.precision)
    replicated = config.dense_replicas > 1
    per_block = config.zero_stage == 3 or (config.zero_stage == 2 and zero2_per_microbatch(config))
    if replicated and not per_block:
        # the once-per-step gradient reduction of the stage holding the average share of the
        # parameters, beside the whole model's backward: no stage's is shorter
        precision = config.precision
        dense = (graph.num_params - facts.expert_params) / (config.tp * config.pp)
        experts = facts.expert_params / (config.ep * config.pp)
        sync = step_sync(dense, experts, config, cluster, precision.param_bytes,
                         precision.grad_bytes,
                         (facts.trainable_params - facts.trainable_expert_params) / (
                             config.tp * config.pp),
                         facts.trainable_expert_params / (config.ep * config.pp),
                         units=max(1, len(graph.blocks) // config.pp))
        window = forward = 0.0
        for blocks in graph.block_types().values():
            c = cached_block_cost(graph, blocks[0].index, config, cluster, "none")
            tp_f, tp_b = tp_lane(c, config.engine, True)
            window += len(blocks) * (c.bwd_s + tp_b + c.ep_comm_s / 2 + c.cp_bwd_comm_s)
            forward += len(blocks) * (c.fwd_s + tp_f + c.ep_comm_s / 2 + c.cp_fwd_comm_s)
        # beside the whole model's forward and backward: no stage's windows are longer, and
        # what stays exposed only shrinks as a window grows
        seconds += step_sync_exposed(sync, window, cluster.device.overlap,
                                     first_forward_s=forward)
    return seconds
