"""Per-op compute time: roofline over FLOPs and bytes, matmul shape effects, kernel overhead.

``time = max(FLOPs / (peak(dtype) x efficiency), bytes / (memory bandwidth x memory
efficiency)) + kernel overhead``.

A matmul runs as output tiles of ``matmul_tile`` elements, one per compute unit (SM) at a time,
in waves. Partial tiles (tile quantization) and a last wave that leaves units idle (wave
quantization) waste the rest of the device, so the rate is the best-shape rate times
``m n / (waves x units x tile area)``, the better of the two tile orientations (NVIDIA's
"Matrix Multiplication Background" guide; e.g. a 1024^3 bf16 matmul is one wave of 32 tiles on
an H100's 132 SMs and reaches about a fifth of peak). Small hidden sizes and small per-device
token counts therefore cost what they cost on the device, not the large-shape rate. Every
launched kernel also costs ``kernel_overhead_s``.

Backward is twice the forward (gradients for inputs and for weights) for every op.
"""

from __future__ import annotations

import math

from autopar.cost.hardware import DeviceSpec
from autopar.ir.graph import OpKind, OpNode

_MATMUL_KINDS = (OpKind.LINEAR, OpKind.MATMUL)


def matmul_dims(op: OpNode) -> tuple[int, int, int]:
    """(m, n, k) of a matmul-like op from its shapes (leading dimensions folded into m)."""
    out = op.output_meta[0].shape if op.output_meta else (1,)
    n = out[-1] if out else 1
    m = max(op.output_meta[0].numel // max(n, 1), 1) if op.output_meta else 1
    k = op.input_meta[0].shape[-1] if op.input_meta and op.input_meta[0].shape else 1
    return m, n, k


def matmul_efficiency(device: DeviceSpec, m: float, n: float, k: float = 0.0) -> float:
    """Achieved / peak rate of an m x n (x k) matmul: the best-shape efficiency times the
    tile and wave utilisation of the device's compute units; on a device calibrated from runs
    (``efficiency.matmul_by_flops``), the rate measured for calls of its size instead of the
    best-shape one."""
    units = max(device.compute_units, 1)
    rows, cols = device.matmul_tile
    m, n = max(m, 1.0), max(n, 1.0)
    best = 0.0
    for a, b in ((rows, cols), (cols, rows)):
        tiles = math.ceil(m / a) * math.ceil(n / b)
        waves = math.ceil(tiles / units)
        best = max(best, m * n / (waves * units * a * b))
    measured = device.efficiency.matmul_at(2 * m * n * k)
    return (device.efficiency.matmul if measured is None else measured) * min(best, 1.0)


def op_time(op: OpNode, device: DeviceSpec, dtype: str, flop_scale: float, byte_scale: float,
            divisor: float = 1.0) -> float:
    """Forward seconds of one op on one device.

    ``flop_scale`` rescales the captured batch to the micro-batch; ``byte_scale`` also converts
    the captured dtype to the compute dtype; ``divisor`` is how many ways the op is split
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
        seconds = max(flops / (peak * eff), memory_time)
    elif op.kind is OpKind.ATTENTION:
        seconds = max(flops / (peak * device.efficiency.attention), memory_time)
    else:
        seconds = max(flops / (peak * device.efficiency.memory), memory_time)
    return seconds + device.kernel_overhead_s
