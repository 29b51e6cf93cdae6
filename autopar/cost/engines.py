"""What each engine issues and overlaps: one table, read by the estimate, the planner's bounds
and the data-parallel step (:mod:`autopar.cost.data_parallel`).

- ``autopar``: autopar's runtime, PyTorch FSDP2 / DDP / DTensor / pipelining. FSDP2 all-gathers
  a block's parameters before its forward and (ZeRO-3) again before its backward, and
  reduce-scatters its gradients after the backward of every micro-batch (ZeRO-2 too: FSDP2
  reshards after each backward), outside a pipeline schedule (see ``llama3-4d``); the next
  block's gather is prefetched beside the current block. Its all-gather copy-out and its
  reduce-scatter copy-in run on the compute stream (``fsdp_copies``). DDP reduces gradients
  beside the last micro-batch's backward.
- ``megatron``: Megatron-LM as the 2021-2022 papers ran it (``overlap_grad_reduce`` and
  ``overlap_param_gather`` off, no tensor-parallel overlap): every collective exposed.
- ``megatron-core``: Megatron-Core with its overlap options on: ``--tp-comm-overlap``
  (TransformerEngine userbuffers: the sequence-parallel all-gathers and reduce-scatters run
  in chunks beside the GEMMs that consume or produce them; needs sequence parallelism),
  ``--overlap-grad-reduce`` (the distributed optimizer's reduce-scatter bucket by bucket
  beside the last micro-batch's backward) and ``--overlap-param-gather`` (the parameter
  all-gather bucket by bucket beside the next step's first forward). Its pipeline sends
  overlap only on the interleaved schedule (``--overlap-p2p-communication`` applies to it
  only), as Megatron-LM's. ZeRO-2/3 are Megatron FSDP (``--use-megatron-fsdp``).
- ``deepspeed``: DeepSpeed ZeRO defaults (see data_parallel.py).
- ``llama3-4d``: Llama 3's 4D setup (Llama Team 2024, arXiv 2407.21783, Section 3.3.2): FSDP
  that does not reshard parameters after the forward (ZeRO-2 semantics), TP and PP, as
  PyTorch's pipelining runs FSDP (torchtitan, the public implementation of that setup):
  ``torch/distributed/pipelining/stage.py`` turns gradient sync and resharding off for every
  backward but the schedule's last action, ``perform_reduce_grad`` (REDUCE_GRAD, scheduled
  after every micro-batch's backward). So each block's parameters are gathered once per step,
  prefetched beside the first micro-batch's forward; its gradients accumulate unsharded (in
  the reduce dtype: FSDP2's ``to_accumulated_grad_if_needed``) and are reduce-scattered once
  per step after the last backward, exposed. autopar's runtime runs the same PyTorch pieces
  and is priced the same way (:func:`fsdp_under_pipeline`); ``llama3-4d`` differs in what it
  may combine (sequence parallelism inside pipeline stages, which autopar's runtime does not
  run). The tensor-parallel collectives are PyTorch's (no userbuffers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from autopar.cost.config import ParallelConfig


@dataclass(frozen=True)
class EngineFeatures:
    """How one engine issues and overlaps its collectives."""

    tp_comm_overlap: bool  # sequence-parallel AG/RS chunked beside their GEMMs (userbuffers)
    grad_reduce_overlap: bool  # once-per-step gradient reduction beside the last backward
    param_gather_overlap: bool  # once-per-step parameter gather beside the first forward
    zero2_per_microbatch: bool  # ZeRO-2 reduce-scatters every micro-batch (FSDP2)
    p2p_overlap_1f1b: bool  # pipeline sends beside compute on non-interleaved schedules
    fsdp_copies: bool  # FSDP2's all-gather copy-out and reduce-scatter copy-in on compute
    fp32_param_master: bool  # the fp32 parameter is the master (no separate master copy)


ENGINE_FEATURES = {
    "autopar": EngineFeatures(tp_comm_overlap=False, grad_reduce_overlap=True,
                              param_gather_overlap=False, zero2_per_microbatch=True,
                              p2p_overlap_1f1b=True, fsdp_copies=True, fp32_param_master=True),
    "megatron": EngineFeatures(tp_comm_overlap=False, grad_reduce_overlap=False,
                               param_gather_overlap=False, zero2_per_microbatch=False,
                               p2p_overlap_1f1b=False, fsdp_copies=False,
                               fp32_param_master=False),
    "megatron-core": EngineFeatures(tp_comm_overlap=True, grad_reduce_overlap=True,
                                    param_gather_overlap=True, zero2_per_microbatch=False,
                                    p2p_overlap_1f1b=False, fsdp_copies=False,
                                    fp32_param_master=False),
    "deepspeed": EngineFeatures(tp_comm_overlap=False, grad_reduce_overlap=False,
                                param_gather_overlap=False, zero2_per_microbatch=False,
                                p2p_overlap_1f1b=True, fsdp_copies=False,
                                fp32_param_master=False),
    "llama3-4d": EngineFeatures(tp_comm_overlap=False, grad_reduce_overlap=True,
                                param_gather_overlap=False, zero2_per_microbatch=True,
                                p2p_overlap_1f1b=True, fsdp_copies=True, fp32_param_master=True),
}

# Megatron-LM and Megatron-Core: pipeline chunks stated as layers per virtual stage
MEGATRON_ENGINES = ("megatron", "megatron-core")
# engines that run each norm and rotary embedding as one fused kernel (Transformer Engine's
# normalization, Megatron-Core's megatron/core/fusions/): autopar.cost.fused_regions.
# Megatron-LM as the 2021-2022 papers ran it stays priced op by op, as it was
FUSED_KERNEL_ENGINES = ("megatron-core",)

# TransformerEngine's userbuffers defaults (NVIDIA/TransformerEngine
# transformer_engine/pytorch/module/base.py, initialize_ub): the all-gathers feeding qkv and fc1
# and the output-gradient all-gathers of proj and fc2 run as a "ring_exchange" over the tp
# ranks (1 SM, copy engines); the reduce-scatters after proj and fc2 as a "pipeline" of 4
# splits on 16 SMs; the backward's input all-gather and dgrad reduce-scatter of qkv and fc1
# in "bulk" beside the dgrad and wgrad GEMMs, on 16 SMs
UB_PIPELINE_SPLITS = 4
UB_PIPELINE_SMS = 16
UB_BULK_SMS = 16
UB_RING_SMS = 1


def engine_features(engine: str) -> EngineFeatures:
    """The features of ``engine`` (one of autopar.cost.config.ENGINES)."""
    return ENGINE_FEATURES[engine]


# the engines that run PyTorch's FSDP2 (fully_shard) and its pipeline schedules
FSDP_ENGINES = ("autopar", "llama3-4d")


def fsdp_under_pipeline(config: ParallelConfig) -> bool:
    """FSDP2 at ZeRO-2/3 under PyTorch's pipeline schedules, which turn gradient sync and
    resharding after the backward off for every micro-batch and reduce-scatter once, after
    the last backward (``torch/distributed/pipelining/stage.py``: ``backward_maybe_with_nosync``
    and the REDUCE_GRAD action ``perform_reduce_grad``): gradients accumulate whole (in the
    reduce dtype) and a block's parameters stay gathered from its backward to its next
    forward."""
    return config.engine in FSDP_ENGINES and config.pp > 1 and config.zero_stage >= 2


def zero2_per_microbatch(config: ParallelConfig) -> bool:
    """Whether ZeRO-2 gathers and reduce-scatters every micro-batch (FSDP2 outside a pipeline
    schedule: it reshards after each backward) rather than once per step."""
    return engine_features(config.engine).zero2_per_microbatch and not \
        fsdp_under_pipeline(config)


def grads_accumulate_unsharded(config: ParallelConfig) -> bool:
    """Whether ZeRO-2/3 gradients stay whole on every data-parallel rank until the step's one
    reduce-scatter (:func:`fsdp_under_pipeline`)."""
    return fsdp_under_pipeline(config)


def sm_share_slowdown(comm_sms: int, compute_units: int) -> float:
    """How much slower a GEMM runs while a communication kernel holds ``comm_sms`` of the
    device's ``compute_units`` SMs (the GEMM gets the rest)."""
    if compute_units <= comm_sms:
        return 0.0  # a device without that many units (a CPU process): no SM partition
    return comm_sms / (compute_units - comm_sms)


def tp_lane(cost, engine: str, train: bool) -> tuple[float, float]:
    """(forward, backward) seconds one micro-batch's tensor-parallel collectives add to a
    block's compute lane on ``engine``: all of them where the engine exposes them, what the
    chunked overlap leaves (``tp_overlap_*_s`` of the block cost) where it overlaps them."""
    if not train:
        return cost.tp_fwd_comm_s, 0.0
    if engine_features(engine).tp_comm_overlap:
        return cost.tp_overlap_fwd_s, cost.tp_overlap_bwd_s
    return cost.tp_comm_s * 0.5, cost.tp_comm_s * 0.5
