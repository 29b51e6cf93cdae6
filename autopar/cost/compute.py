"""Per-op compute time: roofline over FLOPs and bytes with per-kind efficiency.

time = max(FLOPs / (peak(dtype) x efficiency), bytes / (memory bandwidth x memory efficiency)).
Matmul efficiency grows with the smallest matmul dimension d as d / (d + d_half) (small or
skinny matmuls cannot fill the device); ``d_half`` comes from the catalog or `autopar profile`.
Backward is twice the forward (gradients for inputs and for weights) for every op; an op with
no trainable parameter upstream of a frozen weight skips the weight half (not modelled yet).
"""

from __future__ import annotations

from autopar.cost.hardware import DeviceSpec
from autopar.ir.graph import OpKind, OpNode

_MATMUL_KINDS = (OpKind.LINEAR, OpKind.MATMUL)


def matmul_dims(op: OpNode) -> tuple[int, int, int]:
    """(m, n, k) of a matmul-like op from its shapes."""
    out = op.output_meta[0].shape if op.output_meta else (1,)
    n = out[-1] if out else 1
    m = max(op.output_meta[0].numel // max(n, 1), 1) if op.output_meta else 1
    k = op.input_meta[0].shape[-1] if op.input_meta and op.input_meta[0].shape else 1
    return m, n, k


def matmul_efficiency(device: DeviceSpec, m: float, n: float, k: float) -> float:
    d = max(min(m, n, k), 1.0)
    return device.efficiency.matmul * d / (d + device.efficiency.matmul_half_dim)


def op_time(op: OpNode, device: DeviceSpec, dtype: str, flop_scale: float, byte_scale: float,
            divisor: float = 1.0) -> float:
    """Forward seconds of one op on one device.

    ``flop_scale`` rescales the captured batch to the micro-batch; ``byte_scale`` also converts
    the captured dtype to the training dtype; ``divisor`` is how many ways the op is split
    (tensor / sequence / expert parallel).
    """
    if op.kind is OpKind.VIEW:
        return 0.0
    flops = op.flops * flop_scale / divisor
    nbytes = (op.bytes_read + op.bytes_written) * byte_scale / divisor
    peak = device.flops_for(dtype)
    memory_time = nbytes / (device.memory_bandwidth * device.efficiency.memory)
    if op.kind in _MATMUL_KINDS or (op.kind is OpKind.MOE_EXPERT and "mm" in op.target):
        m, n, k = matmul_dims(op)
        eff = matmul_efficiency(device, m * flop_scale, n / divisor, k)
        return max(flops / (peak * eff), memory_time)
    if op.kind is OpKind.ATTENTION:
        return max(flops / (peak * device.efficiency.attention), memory_time)
    return max(flops / (peak * device.efficiency.memory), memory_time)
