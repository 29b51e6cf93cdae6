"""A plan as a DeepSpeed config (JSON), and a DeepSpeed config as constraints.

DeepSpeed's config carries the data-parallel side of a plan: ZeRO stage and offload, the
micro-batch and gradient accumulation, precision, activation checkpointing, and (DeepSpeed
0.16's AutoTP and its pipeline engine) the tensor- and pipeline-parallel sizes. The data-parallel
size is implied: ``train_batch_size = micro-batch x accumulation x dp``.
"""

from __future__ import annotations

from autopar.plan.plan import Plan
from autopar.plan.support import refuse_op_recompute


def deepspeed_config(plan: Plan, grad_clip: float = 1.0) -> dict:
    """The DeepSpeed JSON config that runs ``plan``'s choices."""
    refuse_op_recompute(plan, "DeepSpeed")
    m = plan.mesh
    offload = set(plan.offload)
    zero: dict = {"stage": plan.zero_stage}
    if "optimizer" in offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if "params" in offload:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    compute = plan.training_precision.compute
    config: dict = {
        "train_batch_size": plan.global_batch,
        "train_micro_batch_size_per_gpu": plan.microbatch_size,
        "gradient_accumulation_steps": plan.num_microbatches,
        "gradient_clipping": grad_clip,
        "zero_optimization": zero,
        "bf16": {"enabled": compute == "bf16"},
        "fp16": {"enabled": compute == "fp16", "loss_scale": 0},  # 0: dynamic
    }
    if m["tp"] > 1:
        config["tensor_parallel"] = {"autotp_size": m["tp"]}
    if m["pp"] > 1:
        config["pipeline"] = {"stages": m["pp"]}
    if any(mode != "none" for mode in plan.recompute):
        config["activation_checkpointing"] = {
            "partition_activations": False,
            "cpu_checkpointing": "activations" in offload,
            "contiguous_memory_optimization": False,
        }
    return config


def is_deepspeed(data: dict) -> bool:
    """Whether a loaded mapping is a DeepSpeed config (by its content)."""
    return "zero_optimization" in data or "train_micro_batch_size_per_gpu" in data


def constraints_from_deepspeed(data: dict) -> dict:
    """Constraint keys pinned by a DeepSpeed config."""
    out: dict = {}
    zero = data.get("zero_optimization") or {}
    if "stage" in zero:
        out["zero_stage"] = int(zero["stage"])
    offload = [name for key, name in (("offload_optimizer", "optimizer"),
                                      ("offload_param", "params"))
               if (zero.get(key) or {}).get("device", "none") not in ("none", None)]
    checkpointing = data.get("activation_checkpointing")
    if checkpointing:
        out["recompute"] = "full"
        if checkpointing.get("cpu_checkpointing"):
            offload.append("activations")
    else:
        out["recompute"] = "none"
    out["offload"] = sorted(offload) or "none"
    mb = data.get("train_micro_batch_size_per_gpu")
    accumulation = data.get("gradient_accumulation_steps")
    if mb:
        out["microbatch_size"] = int(mb)
    if accumulation:
        out["num_microbatches"] = int(accumulation)
    if mb and accumulation and data.get("train_batch_size"):
        out["dp"] = int(data["train_batch_size"]) // (int(mb) * int(accumulation))
    out["tp"] = int((data.get("tensor_parallel") or {}).get("autotp_size", 1))
    out["pp"] = int((data.get("pipeline") or {}).get("stages", 1))
    # DeepSpeed-Ulysses: sequence_parallel_size ranks split each sequence, all-to-all over heads
    ulysses = int(data.get("sequence_parallel_size", 1))
    if ulysses > 1:
        out["cp"], out["cp_mode"] = ulysses, "alltoall"
    if (data.get("bf16") or {}).get("enabled"):
        out["precision"] = "bf16"
    elif (data.get("fp16") or {}).get("enabled"):
        out["precision"] = "fp16"
    else:
        out["precision"] = "fp32"
    return out
