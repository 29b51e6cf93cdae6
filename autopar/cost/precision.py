"""Training precision: a plan's precision record and the one dtype table (what each short
dtype name, fp32, tf32, bf16, fp16 or fp8, is in bytes and in torch), and how the cost model
prices it: model-state bytes per parameter for an engine, and the precision a device trains in
by default.

A plan's precision has three dtypes, as PyTorch's ``MixedPrecisionPolicy`` and Megatron name
them: ``param`` (parameters as compute reads them: gathered and unsharded copies), ``compute``
(matmul and attention arithmetic, and activations) and ``reduce`` (gradient reduction and the
gradient buffer). ``loss_scaling`` is dynamic loss scaling, which fp16 needs for its narrow
exponent range. The record lives here, below the plan, because the cost model prices it; the
plan file records it and codegen and the runtime read it from here. Model-state bytes per
parameter follow the mixed-precision Adam accounting of ZeRO (Rajbhandari et al., SC20) and
Megatron-LM's distributed-optimizer table: the parameter in ``param``, the gradient in
``reduce``, and the optimizer's fp32 master copy (when ``param`` is not fp32) plus Adam's two
fp32 moments: fp16 params and grads give ZeRO's 2 + 2 + 12 = 16 bytes per parameter; bf16 with
fp32 reductions gives Megatron's 2 + 4 + 12 = 18; pure fp32 gives 4 + 4 + 8 = 16.
"""


from __future__ import annotations

from dataclasses import dataclass

from autopar.cost.engines import engine_features
from autopar.cost.hardware import DTYPE_ALIASES, DeviceSpec

DTYPE_BYTES = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
# torch's attribute name for each dtype a plan trains in (``getattr(torch, name)``); a name,
# not the dtype itself, so that plan/ does not import torch and generated code can print it
TORCH_DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
ADAM_MOMENT_BYTES = 8  # two fp32 moments per trainable parameter
MASTER_BYTES = 4  # fp32 master weights when parameters are held in a lower precision


@dataclass(frozen=True)
class Precision:
    """Parameter, compute and reduce dtypes (short names: fp32, bf16, fp16, fp8)."""

    param: str
    compute: str
    reduce: str
    loss_scaling: bool = False

    def __post_init__(self) -> None:
        for field in ("param", "compute", "reduce"):
            value = DTYPE_ALIASES.get(getattr(self, field))
            if value is None or value == "tf32":
                raise ValueError(f"precision.{field} must be one of fp32, bf16, fp16, fp8, "
                                 f"got {getattr(self, field)!r}")
            object.__setattr__(self, field, value)

    @property
    def param_bytes(self) -> int:
        return DTYPE_BYTES[self.param]

    @property
    def grad_bytes(self) -> int:
        return DTYPE_BYTES[self.reduce]

    @property
    def optimizer_bytes(self) -> int:
        """Adam's moments plus the fp32 master copy where parameters are held lower."""
        master = 0 if self.param == "fp32" else MASTER_BYTES
        return master + ADAM_MOMENT_BYTES

    @property
    def activation_bytes(self) -> int:
        """Bytes per activation element. FP8 compute keeps activations in bf16: Transformer
        Engine casts only the GEMM operands to FP8, inside its linears."""
        return DTYPE_BYTES["bf16" if self.compute == "fp8" else self.compute]

    def as_dict(self) -> dict:
        """The plan file's ``precision`` mapping."""
        return {"param": self.param, "compute": self.compute, "reduce": self.reduce,
                "loss_scaling": self.loss_scaling}

    @classmethod
    def from_dict(cls, d: dict) -> Precision:
        """A Precision from the plan file's ``precision`` mapping."""
        return cls(str(d["param"]), str(d["compute"]), str(d["reduce"]),
                   bool(d.get("loss_scaling", False)))


FP32 = Precision("fp32", "fp32", "fp32")


def parse_precision(value: object) -> Precision | None:
    """A Precision from a name (``"bf16"``: bf16 params and compute, fp32 reductions;
    ``"fp16"``: the same with loss scaling; ``"fp32"``), a mapping, or None."""
    if value is None or isinstance(value, Precision):
        return value
    if isinstance(value, dict):
        return Precision.from_dict(value)
    name = DTYPE_ALIASES.get(str(value))
    if name == "fp32":
        return FP32
    if name in ("bf16", "fp16"):
        return Precision(name, name, "fp32", loss_scaling=name == "fp16")
    raise ValueError(f"precision must be fp32, bf16, fp16 or a mapping with param/compute/"
                     f"reduce, got {value!r}")


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


def fp32_residual_autocast(engine: str, precision: Precision, *, replicas_sharded: bool,
                           offloads_state: bool) -> str | None:
    """The compute dtype ("bf16", "fp16") when autopar's runtime trains this plan with fp32
    parameters under autocast, so that its residual stream stays fp32; None when the model
    computes in one dtype throughout: another engine (bf16 parameters), fp32, FP8, or
    fully_shard (``replicas_sharded``: ZeRO-2/3 over replicas; or ``offloads_state``) with
    low-precision parameters, whose MixedPrecisionPolicy gathers them in that dtype and casts
    the inputs."""
    if engine != "autopar" or precision.compute not in ("bf16", "fp16"):
        return None
    if (replicas_sharded or offloads_state) and precision.param != "fp32":
        return None
    return precision.compute
