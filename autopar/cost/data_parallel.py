"""Data-parallel communication: which collectives each ZeRO stage issues, at what granularity,
and how much of them hides behind compute. One function per term; the estimate, the planner's
bounds and the tests all call these.

Overlap (``overlapped``): a collective issued beside compute runs concurrently with it for
``concurrent`` of its time; while both run, compute is ``compute_slowdown`` slower (the
collective's kernels take SMs and memory bandwidth); what does not run concurrently is exposed.

Collectives as the engines issue them:

- ``autopar`` (autopar's runtime: PyTorch FSDP2 / DDP):
  ZeRO-3 all-gathers each block's parameters before its forward and again before its
  backward, and reduce-scatters its gradients after its backward, every micro-batch; the next
  block's all-gather is prefetched (depth 1, FSDP2's default) beside the current block's
  compute: a gather never overlaps the compute it feeds, so the first one of each pass is
  exposed. ZeRO-2 (``reshard_after_forward=False``) gathers once per micro-batch, in its
  forward: FSDP2 reshards after every backward (``reshard_after_backward`` defaults on).
  FSDP2 also copies on the compute stream (torch/distributed/fsdp/_fully_shard/
  _fsdp_collectives.py): after each all-gather, ``split_with_sizes_copy`` copies the gathered
  block out into its parameters (``foreach_all_gather_copy_out``, reads and writes the block's
  bytes), and before each reduce-scatter ``chunk_cat`` copies the block's unsharded gradients
  into the reduce-scatter input in the reduce dtype (``foreach_reduce``, before the
  reduce-scatter stream waits on the compute stream): memory-bound copies priced at the
  device's copy bandwidth. The all-gather copy-in (the shard into the gather buffer) runs on
  its own stream and moves a 1/dp share: not priced. ZeRO-2 reduce-scatters every
  micro-batch. ZeRO-0/1 all-reduce gradients once per step in 25 MB buckets (DDP's
  ``bucket_cap_mb``) beside the last micro-batch's backward; ZeRO-1 then all-gathers the
  updated parameter shards after the optimizer step.
- ``megatron`` (Megatron-LM defaults, ``overlap_grad_reduce = overlap_param_gather = False``):
  gradients are all-reduced (ZeRO-1, the distributed optimizer: reduce-scattered, then the
  parameters all-gathered after the step) after the backward, exposed, in buckets of
  ``max(4e7, 1e6 x dp)`` parameters.
- ``megatron-core`` (``--overlap-grad-reduce --overlap-param-gather``): the same buckets, the
  gradient reduction beside the last micro-batch's backward (its last bucket after it) and
  the parameter all-gather beside the next step's first forward (its first bucket before it).
  Megatron FSDP (``--use-megatron-fsdp``) at ZeRO-3 gathers and reduce-scatters per block as
  FSDP2 does; FSDP2's copies are not priced for it (it keeps parameters in buffers of its
  own; not checked against its source); at ZeRO-2
  (``optim_grads``) as at ZeRO-1, once per step.
- FSDP under PyTorch's pipeline schedules (``autopar`` and ``llama3-4d`` with pipeline
  stages, ZeRO-2/3; ``engines.fsdp_under_pipeline``): each block is one bucket, its gradients
  reduce-scattered once per step after the last backward (the schedule's REDUCE_GRAD action),
  exposed; under ZeRO-2 its parameters all-gathered once per step beside the first
  micro-batch's forward; under ZeRO-3 gathered again in every micro-batch's backward (they
  stay gathered from there to the next forward, which reshards them).
- ``deepspeed`` (DeepSpeed ZeRO defaults): ZeRO-3 gathers parameter by parameter (one
  all-gather per parameter tensor, prefetched beside compute, ``overlap_comm`` on) and
  reduce-scatters gradients in buckets of 5e8 elements; ZeRO-1/2 reduce in 5e8-element
  buckets after the backward (``overlap_comm`` off) and all-gather parameters after the step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from autopar.cost.comm import axis_collective_time
from autopar.cost.config import ParallelConfig
from autopar.cost.engines import (
    MEGATRON_ENGINES,
    TORCH_FSDP_ENGINES,
    engine_features,
    grads_accumulate_unsharded,
    zero2_per_microbatch,
)
from autopar.cost.hardware import Cluster, DeviceSpec, Overlap

DDP_BUCKET_BYTES = 25e6  # torch DistributedDataParallel bucket_cap_mb default (25 MB)
MEGATRON_BUCKET_PARAMS = 4e7  # Megatron-LM DDP: max(40M, 1M x dp) parameters per bucket
DEEPSPEED_BUCKET_ELEMENTS = 5e8  # DeepSpeed ZeRO reduce_bucket_size / allgather_bucket_size


def overlapped(compute_s: float, comm_s: float, overlap: Overlap) -> float:
    """Wall seconds of ``compute_s`` of compute with ``comm_s`` of collectives issued beside it
    (neither waits for the other)."""
    concurrent = min(comm_s * overlap.concurrent, compute_s)
    return compute_s + overlap.compute_slowdown * concurrent + (comm_s - concurrent)


def forward_with_gathers(compute_s: list[float], gather_s: list[float],
                         overlap: Overlap) -> float:
    """One micro-batch's forward over blocks whose parameters are gathered just in time: the
    first gather is exposed, each next one is prefetched beside the current block."""
    if not compute_s:
        return 0.0
    total = gather_s[0]
    for i, c in enumerate(compute_s):
        nxt = gather_s[i + 1] if i + 1 < len(gather_s) else 0.0
        total += overlapped(c, nxt, overlap)
    return total


def backward_with_collectives(compute_s: list[float], gather_s: list[float],
                              reduce_s: list[float], overlap: Overlap) -> float:
    """One micro-batch's backward, last block first: the last block's gather is exposed; beside
    each block run the previous block's gather (prefetch) and the reduce-scatter of the block
    just finished; the first block's reduce-scatter is exposed at the end."""
    n = len(compute_s)
    if n == 0:
        return 0.0
    total = gather_s[-1]
    for i in range(n - 1, -1, -1):
        beside = (gather_s[i - 1] if i > 0 else 0.0) + (reduce_s[i + 1] if i + 1 < n else 0.0)
        total += overlapped(compute_s[i], beside, overlap)
    return total + reduce_s[0]


@dataclass
class BlockTraffic:
    """One block's data-parallel collectives on one device, seconds each."""

    gather_s: float  # all-gather of its parameters (ZeRO-2/3)
    reduce_s: float  # reduce-scatter of its gradients (ZeRO-2/3)
    # FSDP2's copies on the compute stream: out of each all-gather, into each reduce-scatter
    gather_copy_s: float = 0.0
    reduce_copy_s: float = 0.0


def copy_time(nbytes_read: float, nbytes_written: float, device: DeviceSpec) -> float:
    """A memory-bound copy on the device: its bytes at the achieved copy bandwidth."""
    return (nbytes_read + nbytes_written) / (device.memory_bandwidth * device.efficiency.memory)


def _bucketed(kind: str, nbytes: float, bucket_bytes: float, config: ParallelConfig, axis: str,
              cluster: Cluster) -> float:
    if nbytes <= 0:
        return 0.0
    buckets = max(1, math.ceil(nbytes / bucket_bytes))
    return buckets * axis_collective_time(kind, nbytes / buckets, config, axis, cluster)


def _replicas_axis(expert: bool) -> str:
    return "expert_dp" if expert else "dense_dp"


def block_traffic(dense: float, expert: float, tensors: int, config: ParallelConfig,
                  cluster: Cluster, param_bytes: int, grad_bytes: int,
                  trainable_dense: float | None = None,
                  trainable_expert: float | None = None) -> BlockTraffic:
    """The sharded-data-parallel collectives of one block holding ``dense`` and ``expert``
    parameter elements (``tensors`` parameter tensors) on this device, of which the
    ``trainable_*`` ones (all by default) have gradients to reduce."""
    gather = reduce = gather_copy = reduce_copy = 0.0
    trainable = {"dense_dp": dense if trainable_dense is None else trainable_dense,
                 "expert_dp": expert if trainable_expert is None else trainable_expert}
    features = engine_features(config.engine)
    for numel, axis in ((dense, "dense_dp"), (expert, "expert_dp")):
        if numel <= 0:
            continue
        param_b = numel * param_bytes
        grad_b = trainable[axis] * grad_bytes
        if features.fsdp_copies:
            # copy-out: the gathered block into its parameters; copy-in: the gradients (in
            # the parameter dtype, as autograd made them) into the reduce dtype's buffer
            gather_copy += copy_time(param_b, param_b, cluster.device)
            reduce_copy += copy_time(trainable[axis] * param_bytes, grad_b, cluster.device)
        elif features.reduce_cast and grad_bytes != param_bytes:
            # FSDP1's flat gradient cast to the reduce dtype (engines.py, llm-foundry)
            reduce_copy += copy_time(trainable[axis] * param_bytes, grad_b, cluster.device)
        if config.engine == "deepspeed":
            count = max(tensors, 1)
            gather += count * axis_collective_time("all_gather", param_b / count, config, axis,
                                                   cluster)
            reduce += _bucketed("reduce_scatter", grad_b,
                                DEEPSPEED_BUCKET_ELEMENTS * grad_bytes, config, axis, cluster)
        else:
            gather += axis_collective_time("all_gather", param_b, config, axis, cluster)
            reduce += axis_collective_time("reduce_scatter", grad_b, config, axis, cluster)
    return BlockTraffic(gather, reduce, gather_copy, reduce_copy)


@dataclass
class StepSync:
    """Per-step data-parallel collectives outside the micro-batch loop."""

    grad_s: float  # gradient reduction (ZeRO-0/1), before any overlap
    grad_last_s: float  # its last bucket: always after the backward
    grad_overlaps: bool  # issued beside the last micro-batch's backward
    param_s: float  # parameter all-gather after the optimizer step (ZeRO-1, megatron/deepspeed)
    param_overlaps: bool = False  # issued beside the next step's first forward
    param_first_s: float = 0.0  # its first bucket: always before that forward


def step_sync(dense: float, expert: float, config: ParallelConfig, cluster: Cluster,
              param_bytes: int, grad_bytes: int, trainable_dense: float | None = None,
              trainable_expert: float | None = None, units: int = 1) -> StepSync:
    """The once-per-step gradient reduction and parameter gathers of ZeRO-0/1 (and ZeRO-2 on
    every engine but autopar's), for a stage holding ``dense``/``expert`` elements in
    ``units`` blocks, of which the ``trainable_*`` ones (all by default) have gradients."""
    grad = last = param = first = 0.0
    features = engine_features(config.engine)
    zero2 = config.zero_stage == 2
    # FSDP under a pipeline schedule: one reduce-scatter per block (FSDP unit) per step, and
    # at ZeRO-2 one all-gather (ZeRO-3's gathers are per micro-batch, priced by the stage)
    per_unit = grads_accumulate_unsharded(config)
    sync = config.zero_stage <= 1 or (zero2 and not zero2_per_microbatch(config)) or per_unit
    if not sync:
        return StepSync(0.0, 0.0, False, 0.0)
    replicas = config.dense_replicas
    trainable = {"dense_dp": dense if trainable_dense is None else trainable_dense,
                 "expert_dp": expert if trainable_expert is None else trainable_expert}
    for numel, axis in ((dense, "dense_dp"), (expert, "expert_dp")):
        if numel <= 0:
            continue
        grad_b = trainable[axis] * grad_bytes
        param_b = numel * param_bytes
        if per_unit:
            bucket = grad_b / max(units, 1)
        elif config.engine in MEGATRON_ENGINES:
            bucket = max(MEGATRON_BUCKET_PARAMS, 1e6 * replicas) * grad_bytes
        elif config.engine == "deepspeed":
            bucket = DEEPSPEED_BUCKET_ELEMENTS * grad_bytes
        else:
            bucket = DDP_BUCKET_BYTES
        ddp = config.engine in TORCH_FSDP_ENGINES and not per_unit
        kind = "all_reduce" if config.zero_stage == 0 or ddp else "reduce_scatter"
        if grad_b > 0:  # a stage of frozen weights only (fine-tuning) reduces nothing
            grad += _bucketed(kind, grad_b, bucket, config, axis, cluster)
            last += axis_collective_time(kind, min(grad_b, bucket), config, axis, cluster)
        if 1 <= config.zero_stage <= 2:
            # one gather per FSDP unit of what it holds, trained or frozen
            param_bucket = param_b / max(units, 1) if per_unit \
                else bucket * param_bytes / grad_bytes
            param += _bucketed("all_gather", param_b, param_bucket, config, axis, cluster)
            first += axis_collective_time("all_gather", min(param_b, param_bucket), config,
                                          axis, cluster)
    # FSDP prefetches the gathers beside the first forward; autopar's ZeRO-1
    # (ZeroRedundancyOptimizer) gathers after the step, exposed
    param_overlaps = features.param_gather_overlap or per_unit
    # the pipeline schedule's REDUCE_GRAD comes after every backward: nothing to hide behind
    grad_overlaps = features.grad_reduce_overlap and not per_unit
    return StepSync(grad, min(last, grad), grad_overlaps, param, param_overlaps,
                    min(first, param))


def step_sync_exposed(sync: StepSync, last_backward_s: float, overlap: Overlap,
                      first_forward_s: float = 0.0) -> float:
    """Seconds the step waits for its once-per-step data-parallel collectives: the gradient
    reduction beside the last micro-batch's backward (its last bucket after it), or after the
    backward where the engine does not overlap it; the parameter gather beside the first
    micro-batch's forward (``first_forward_s``; its first bucket before it) where the engine
    overlaps it, else after the step."""
    if sync.grad_overlaps:
        early = max(sync.grad_s - sync.grad_last_s, 0.0)
        grad = overlapped(last_backward_s, early, overlap) - last_backward_s + sync.grad_last_s
    else:
        grad = sync.grad_s
    if sync.param_overlaps:
        rest = max(sync.param_s - sync.param_first_s, 0.0)
        param = overlapped(first_forward_s, rest, overlap) - first_forward_s \
            + sync.param_first_s
    else:
        param = sync.param_s
    return grad + param
