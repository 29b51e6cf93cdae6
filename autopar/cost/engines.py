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
- ``llm-foundry``: MosaicML's llm-foundry on Composer, which wraps the model in PyTorch FSDP1
  (``FullyShardedDataParallel``, flat parameters): a block's flat parameter is all-gathered
  straight into the unsharded flat buffer its parameters are views of (no FSDP2 copy-out), and
  its flat gradient is reduce-scattered as one contiguous tensor; Composer syncs every
  micro-batch under FSDP (``composer/trainer/dist_strategy.py``, ``ddp_sync_context``: no
  ``no_sync`` unless the model is DistributedDataParallel), so FULL_SHARD (ZeRO-3) and
  SHARD_GRAD_OP (ZeRO-2) gather and reduce-scatter per micro-batch as FSDP2 does. Where the
  reduce dtype differs from the parameter dtype (Composer's mixed precision DEFAULT: fp32
  reductions), FSDP1 casts the flat gradient to it before the reduce-scatter
  (``torch/distributed/fsdp/_runtime_utils.py``, ``_post_backward_hook``): a copy on the
  compute stream (``reduce_cast``); PURE reduces in bf16 and copies nothing. No pipeline
  schedule (Composer has none).

The Megatron engines (``megatron``, ``megatron-core``, and ``deepspeed``, which runs
Megatron-DeepSpeed's model code) split a tied embedding and LM head by vocabulary over the tp
ranks (``tied_vocab_parallel``): ``VocabParallelEmbedding`` holds the rank's rows of the table
and ``parallel_lm_logits`` multiplies by that same shard (the last pipeline stage keeps its
own copy of it, ``initialize_word_embeddings``); autopar's runtime keeps a tied table whole.

The loss's memory (``loss``, bytes per logit element held at the loss's peak, besides the
activations) is the engine's too, as its source computes the cross-entropy:

- ``"fp32-copy"`` (``autopar``, ``llama3-4d``): an eager loss on the logits cast to fp32
  (autopar's ``train/loss.py``, ``logits.float()``; torchtitan's ``cross_entropy_loss``,
  ``pred.flatten(0, 1).float()``). Its peak is log-softmax's backward: the fp32 output autograd
  saved, the fp32 gradient the nll loss hands it and the fp32 gradient it writes, 12 bytes
  (measured with PyTorch's memory profiler on CPU, ``tests/cost/test_loss_memory.py``); the
  logits in the compute dtype are released before the backward (autopar's Trainer drops the
  model's output; torchtitan ``del pred``).
- ``"fp32-inplace"`` (``megatron``, ``megatron-core``, ``deepspeed``): Megatron's
  vocab-parallel cross-entropy casts its logits shard to fp32 (Megatron-LM 2021,
  ``output.float()`` unless ``--fp16-lm-cross-entropy``; Megatron-Core's
  ``VocabParallelCrossEntropy.calculate_logits_max``, fused or not,
  ``megatron/core/fusions/fused_cross_entropy.py``), turns it into the softmax in place, saves
  it, writes the gradient into it in the backward and casts that to the logits' dtype: 4 bytes
  plus one compute-dtype copy. Megatron-DeepSpeed runs Megatron-LM's loss.
- ``"fused"`` (``llm-foundry``): MPT's default ``loss_fn: fused_crossentropy`` is flash-attn's
  ``CrossEntropyLoss`` (``llmfoundry/models/mpt/modeling_mpt.py``), a Triton kernel that reads
  the logits in their dtype and, with ``inplace_backward=False`` (llm-foundry does not set
  it), writes their gradient into a new tensor of the same dtype
  (``flash_attn/ops/triton/cross_entropy.py``: ``torch.empty_like(logits)``): two
  compute-dtype copies.
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
    loss: str = "fp32-copy"  # how the loss holds the logits (LOSS_KINDS)
    reduce_cast: bool = False  # without FSDP2's copies: gradients cast to a wider reduce dtype
    tied_vocab_parallel: bool = False  # a tied embedding and LM head share one vocab shard
    # pipeline stages send whole activations under sequence parallelism (autopar's runtime
    # gathers at a stage's last layer); Megatron sends the sequence shard, 1 / tp of them
    whole_p2p_under_sp: bool = False
    # all-to-all (Ulysses) context parallelism with fewer key/value heads per tp rank than cp
    # ranks: autopar's runtime repeats them per query head before the all-to-all
    # (parallel/alltoall_attention.py); elsewhere such a split is refused
    ulysses_replicates_kv: bool = False


# bytes per logit element the loss holds at its peak, given the compute dtype's bytes (see
# the module docstring for each engine's source)
LOSS_KINDS = {
    "fp32-copy": lambda compute_bytes: 4 + 4 + 4,
    "fp32-inplace": lambda compute_bytes: 4 + compute_bytes,
    "fused": lambda compute_bytes: 2 * compute_bytes,
}


ENGINE_FEATURES = {
    "autopar": EngineFeatures(tp_comm_overlap=False, grad_reduce_overlap=True,
                              param_gather_overlap=False, zero2_per_microbatch=True,
                              p2p_overlap_1f1b=True, fsdp_copies=True, fp32_param_master=True,
                              whole_p2p_under_sp=True, ulysses_replicates_kv=True),
    "megatron": EngineFeatures(tp_comm_overlap=False, grad_reduce_overlap=False,
                               param_gather_overlap=False, zero2_per_microbatch=False,
                               p2p_overlap_1f1b=False, fsdp_copies=False,
                               fp32_param_master=False, loss="fp32-inplace",
                               tied_vocab_parallel=True),
    "megatron-core": EngineFeatures(tp_comm_overlap=True, grad_reduce_overlap=True,
                                    param_gather_overlap=True, zero2_per_microbatch=False,
                                    p2p_overlap_1f1b=False, fsdp_copies=False,
                                    fp32_param_master=False, loss="fp32-inplace",
                                    tied_vocab_parallel=True),
    "deepspeed": EngineFeatures(tp_comm_overlap=False, grad_reduce_overlap=False,
                                param_gather_overlap=False, zero2_per_microbatch=False,
                                p2p_overlap_1f1b=True, fsdp_copies=False,
                                fp32_param_master=False, loss="fp32-inplace",
                                tied_vocab_parallel=True),
    "llama3-4d": EngineFeatures(tp_comm_overlap=False, grad_reduce_overlap=True,
                                param_gather_overlap=False, zero2_per_microbatch=True,
                                p2p_overlap_1f1b=True, fsdp_copies=True, fp32_param_master=True),
    # FSDP1's flat parameters: no copy-out or copy-in (module docstring); fp32 sharded flat
    # parameters are the master (FSDP1's MixedPrecision casts the gathered copy)
    "llm-foundry": EngineFeatures(tp_comm_overlap=False, grad_reduce_overlap=True,
                                  param_gather_overlap=False, zero2_per_microbatch=True,
                                  p2p_overlap_1f1b=True, fsdp_copies=False,
                                  fp32_param_master=True, loss="fused", reduce_cast=True),
}

# Megatron-LM and Megatron-Core: pipeline chunks stated as layers per virtual stage
MEGATRON_ENGINES = ("megatron", "megatron-core")


def megatron_chunks_divide(engine: str, layers: int, chunks: int) -> bool:
    """Whether Megatron splits ``layers`` evenly over ``chunks`` model chunks (pp x virtual
    stages). Megatron-Core can also count the embedding and the loss as one layer each
    (``--account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split``,
    ``megatron/core/transformer/transformer_block.py``: ``get_num_layers_to_build`` adds one
    per flag before dividing): Llama 3.1 405B's 126 layers over pp8 x vp8 run that way."""
    if layers % chunks == 0:
        return True
    return engine == "megatron-core" and (layers + 2) % chunks == 0
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
# the engines whose ZeRO is PyTorch FSDP (FSDP2 or FSDP1): ZeRO-2 keeps the fp32 master
# parameters sharded, and ZeRO-0/1 is PyTorch DDP
TORCH_FSDP_ENGINES = (*FSDP_ENGINES, "llm-foundry")


def loss_bytes_per_logit(engine: str, compute_bytes: int) -> float:
    """Bytes per logit element ``engine``'s loss holds at its peak (the logits and their
    gradient as its cross-entropy keeps them), for logits in a ``compute_bytes`` dtype."""
    return float(LOSS_KINDS[engine_features(engine).loss](compute_bytes))


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
