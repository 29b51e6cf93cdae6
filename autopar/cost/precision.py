"""Training precision as the cost model prices it: model-state bytes per parameter for an
engine, and the precision a device trains in by default.

The precision record itself (:class:`Precision`), the dtype table and :func:`parse_precision`
live with the plan (:mod:`autopar.plan.precision`); they are re-exported here for the cost
model's callers. fp16 params and grads give ZeRO's 2 + 2 + 12 = 16 bytes per parameter; bf16
with fp32 reductions gives Megatron's 2 + 4 + 12 = 18; pure fp32 gives 4 + 4 + 8 = 16.
"""

from __future__ import annotations

from autopar.cost.engines import engine_features
from autopar.cost.hardware import DeviceSpec
from autopar.plan.precision import (
    ADAM_MOMENT_BYTES,
    DTYPE_BYTES,
    FP32,
    MASTER_BYTES,
    Precision,
    parse_precision,
)

__all__ = ["ADAM_MOMENT_BYTES", "DTYPE_BYTES", "FP32", "MASTER_BYTES", "Precision",
           "default_precision", "parse_precision", "state_bytes"]


def state_bytes(precision: Precision, engine: str) -> tuple[int, int, int, int]:
    """Bytes per parameter of (the parameter as held, its gradient, optimizer states, a
    transient copy in the compute dtype) for an engine.

    Megatron-LM and DeepSpeed hold the parameter in ``param`` and an fp32 master copy in the
    optimizer. autopar's runtime holds the fp32 parameter itself as the master: FSDP2's
    MixedPrecisionPolicy gathers it cast to ``param`` per block, and autocast casts it per
    step otherwise, so the low-precision copy is transient (counted with the buffers); so does
    Llama 3's FSDP (``llama3-4d``).
    """
    if engine_features(engine).fp32_param_master and precision.param != "fp32":
        return MASTER_BYTES, precision.grad_bytes, ADAM_MOMENT_BYTES, precision.param_bytes
    return precision.param_bytes, precision.grad_bytes, precision.optimizer_bytes, 0


def default_precision(device: DeviceSpec) -> Precision:
    """The fastest precision the device trains in: bf16 compute with fp32 reductions where its
    matrix units run bf16; fp16 with dynamic loss scaling where they run only fp16 (V100);
    fp32 where there are no matrix units (CPU)."""
    if "bf16" in device.tensor_core_dtypes:
        return Precision("bf16", "bf16", "fp32")
    if "fp16" in device.tensor_core_dtypes:
        return Precision("fp16", "fp16", "fp32", loss_scaling=True)
    return FP32
