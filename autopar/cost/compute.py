"""Per-op compute time, forward and backward, as training kernels run on the device.

``time = max(FLOPs / (peak(dtype) x efficiency), bytes / (memory bandwidth x memory
efficiency)) + kernel overhead``, and never less than the host's time to issue the kernel.

- **Matmuls** run as output tiles of ``matmul_tile`` elements, one per compute unit (SM) at a
  time, in waves. Partial tiles (tile quantization) and a last wave that leaves units idle (wave
  quantization) waste the rest of the device, so the rate is the best-shape rate times
  ``m n / (waves x units x tile area)``, the better of the two tile orientations (NVIDIA's
  "Matrix Multiplication Background" guide; e.g. a 1024^3 bf16 matmul is one wave of 32 tiles
  on an H100's 132 SMs and reaches about a fifth of peak). The best-shape rate is a short burst
  at boost clock; a training loop keeps the device at its power limit, where Tensor-Core work
  runs at ``efficiency.sustained_clock`` of that rate. The backward runs two matmuls of their
  own shapes: the input gradient (``m x k`` output, reducing over ``n``) and, for a trainable
  weight, the weight gradient (``n x k`` output, reducing over the ``m`` tokens).
- **Fused attention** (flash kernels behind ``scaled_dot_product_attention``) is priced by what
  the kernel computes: a causal mask skips the blocks above the diagonal, so the kernel does
  half the FLOPs the IR counts (the IR counts the full score matrix, as Megatron-LM does). The
  forward runs at ``attention_forward`` of peak, the backward does 2.5x the forward's FLOPs
  (five matmuls against two) at ``attention_backward``, both ramped by the keys each query tile
  visits: ``s / (s + attention_ramp_tokens)``. Unfused attention (matmul, softmax, matmul)
  stays priced op by op, its matmuls at ``efficiency.attention``.
- **Memory-bound ops** (norms, activations, rotary, softmax, dropout, cross-entropy, copies)
  move their bytes at the achieved bandwidth; fp32 upcasts are counted at the dtype the graph
  holds. Their backward moves what PyTorch's autograd formula for the op moves
  (:func:`backward_kernels`): nothing for an add of equal shapes (the gradient passes through),
  one kernel per tensor operand for a product, one kernel reading the output gradient and the
  saved tensors for anything else.
- **FP8** (``compute: fp8``) is Transformer Engine's recipe: only the linears' GEMMs run in
  FP8, at ``efficiency.matmul_fp8`` of the FP8 peak; attention, the unfused matmuls and every
  memory-bound op stay in bf16 (:func:`kernel_dtype`). Each FP8 GEMM operand is first cast by a
  memory-bound kernel that also writes the transposed copy Hopper's TN-only FP8 GEMMs need
  (:func:`fp8_cast_seconds`).
- Every launched kernel costs ``kernel_overhead_s`` on the device, and takes at least
  ``dispatch_overhead_s`` of host time to issue from eager PyTorch: a kernel shorter than that
  leaves the device idle, which is what small models and small per-device batches pay.
"""

from __future__ import annotations

import math

from autopar.capture.op_costs import packet_name
from autopar.cost.hardware import DeviceSpec
from autopar.ir.graph import OpKind, OpNode

_MATMUL_KINDS = (OpKind.LINEAR, OpKind.MATMUL)
# autograd formulas (PyTorch's tools/autograd/derivatives.yaml) by the data they move:
# a sum's gradient is the output gradient itself (reduced only where an operand broadcast)
_PASS_THROUGH = {"add", "sub", "add_", "sub_"}
# a product's gradient for each tensor operand is the output gradient times the other one
_PRODUCT = {"mul", "div", "mul_", "div_"}
# a sum or mean's gradient is the output gradient broadcast back to the input's shape
_BROADCAST_BACK = {"sum", "mean", "expand", "repeat"}
# ops without a gradient (creation, indexing by integers, comparisons)
_NO_GRAD = {"arange", "zeros", "ones", "full", "empty", "new_ones", "new_zeros", "new_full",
            "new_empty", "empty_like", "zeros_like", "ones_like", "full_like", "rand", "randn",
            "scalar_tensor", "randint", "rand_like", "randn_like", "empty_strided", "eq", "ne",
            "lt", "le", "gt", "ge", "argmax", "argmin", "argsort", "bincount", "histc",
            "count_nonzero", "any", "all", "sym_size", "sym_numel", "_local_scalar_dense"}
# the fused kernels' backward: recompute the scores, then dV, dP, dQ and dK (FlashAttention-2,
# Dao 2023, Sec. 3.1.2; flash-attention's benchmarks count backward FLOPs as 2.5x forward)
ATTENTION_BACKWARD_FLOPS = 2.5
# Transformer Engine's FP8 cast of a bf16 tensor: read it (2 bytes an element), write the FP8
# copy and its transpose (1 + 1 bytes): Hopper's cuBLASLt FP8 GEMMs take only the "TN" layout,
# so the wgrad / dgrad GEMMs need the transposed ("columnwise") copy (TransformerEngine docs,
# low_precision_training/performance_considerations, "Handling transposes")
FP8_CAST_BYTES_PER_ELEMENT = 4.0


def is_gemm(op: OpNode) -> bool:
    """A matmul-like op priced by its tiles (linear, matmul, grouped expert matmul)."""
    return op.kind in _MATMUL_KINDS or (op.kind is OpKind.MOE_EXPERT and "mm" in op.target)


def kernel_dtype(op: OpNode, dtype: str) -> str:
    """The dtype ``op``'s kernel computes in when the plan computes in ``dtype``: under FP8
    only the linears (dense and grouped expert GEMMs with a weight) run in FP8, as Transformer
    Engine's ``fp8_autocast`` runs them; attention, matmuls of two activations and memory-bound
    ops stay in bf16."""
    if dtype != "fp8":
        return dtype
    weighted = op.kind is OpKind.LINEAR or (op.kind is OpKind.MOE_EXPERT and "mm" in op.target)
    return "fp8" if weighted else "bf16"


def fp8_cast_seconds(device: DeviceSpec, elements: float) -> float:
    """Seconds of one Transformer Engine cast (+ transpose) of ``elements`` bf16 values to
    FP8, a memory-bound kernel at the achieved bandwidth (amax is reduced in the same pass)."""
    seconds = elements * FP8_CAST_BYTES_PER_ELEMENT / (device.memory_bandwidth
                                                       * device.efficiency.memory)
    return _issue(device, seconds)


def matmul_dims(op: OpNode) -> tuple[int, int, int]:
    """(m, n, k) of a matmul-like op from its shapes (leading dimensions folded into m)."""
    out = op.output_meta[0].shape if op.output_meta else (1,)
    n = out[-1] if out else 1
    m = max(op.output_meta[0].numel // max(n, 1), 1) if op.output_meta else 1
    k = op.input_meta[0].shape[-1] if op.input_meta and op.input_meta[0].shape else 1
    return m, n, k


def tile_utilisation(device: DeviceSpec, m: float, n: float) -> float:
    """Share of the device's compute units an ``m x n`` matmul output keeps busy: its tiles
    in waves over the units, the better of the two tile orientations."""
    units = max(device.compute_units, 1)
    rows, cols = device.matmul_tile
    m, n = max(m, 1.0), max(n, 1.0)
    best = 0.0
    for a, b in ((rows, cols), (cols, rows)):
        tiles = math.ceil(m / a) * math.ceil(n / b)
        waves = math.ceil(tiles / units)
        best = max(best, m * n / (waves * units * a * b))
    return min(best, 1.0)


def matmul_efficiency(device: DeviceSpec, m: float, n: float, k: float = 0.0,
                      sustained: bool = True, dtype: str = "bf16") -> float:
    """Achieved / peak rate of an m x n (x k) matmul: the best-shape efficiency times the
    tile and wave utilisation of the device's compute units, at the clock the device sustains
    in a training loop (``sustained=False``: a single burst at boost clock); on a device
    calibrated from runs (``efficiency.matmul_by_flops``), the rate measured for calls of its
    size instead of the best-shape one. ``dtype`` picks the best-shape rate of that dtype
    (FP8 GEMMs: ``efficiency.matmul_fp8``)."""
    measured = device.efficiency.matmul_at(2 * m * n * k)
    best = device.efficiency.matmul_for(dtype) if measured is None else measured
    clock = device.efficiency.sustained if sustained and measured is None else 1.0
    return best * clock * tile_utilisation(device, m, n)


def is_fused_attention(op: OpNode) -> bool:
    """A fused attention kernel (scaled_dot_product_attention and its flash variants)."""
    return op.kind is OpKind.ATTENTION and (
        "scaled_dot_product" in op.target or "flex_attention" in op.target)


def attention_shape(op: OpNode) -> tuple[int, int, bool]:
    """(query tokens, key tokens, causal) of a fused attention op. Self-attention over a
    sequence (as many queries as keys, more than one) is taken as causal: the IR does not keep
    ``is_causal``, and the models autopar plans (decoder language models) mask causally."""
    if len(op.input_meta) < 2 or len(op.input_meta[0].shape) < 2:
        return 1, 1, False
    s_q, s_k = op.input_meta[0].shape[-2], op.input_meta[1].shape[-2]
    return s_q, s_k, s_q == s_k and s_q > 1


def attention_efficiency(device: DeviceSpec, keys: float, backward: bool) -> float:
    """Useful FLOP/s over peak of the fused attention kernel, forward or backward, when each
    query tile visits ``keys`` keys, at the clock the device sustains."""
    eff = device.efficiency
    rate = eff.attention_backward if backward else eff.attention_forward
    if rate is None:
        rate = eff.attention
    ramp = eff.attention_ramp_tokens or 0.0
    return rate * eff.sustained * keys / (keys + ramp)


def backward_kernels(op: OpNode) -> tuple[int, float]:
    """(kernels, bytes at the captured size) the backward of a memory-bound op runs.

    An add passes its output gradient through (a reduction only for an operand it broadcast);
    a product runs one kernel per tensor operand, each reading the output gradient and the
    other operand and writing that operand's gradient; every other op (an activation, a norm,
    softmax, dropout, a copy, cross-entropy) one kernel reading the output gradient and the
    saved inputs and writing the input gradients; creation and integer ops none.
    """
    name = packet_name(op.target)
    out = float(op.bytes_written)
    # integer and boolean tensors (masks, positions, indices) carry no gradient
    floats = [m for m in op.input_meta if m.dtype.startswith(("float", "bfloat"))]
    ins = [m.nbytes for m in floats]
    if name in _NO_GRAD or not floats or (op.kind is OpKind.OTHER and name not in (
            "index", "index_select", "gather")):
        return 0, 0.0
    if name in _BROADCAST_BACK:  # the gradient expanded back to the input
        return 1, out + float(sum(ins))
    if name in _PASS_THROUGH:
        reduced = [out + b for b, m in zip(ins, floats, strict=False)
                   if m.numel * 2 <= max(op.output_meta[0].numel if op.output_meta else 0, 1)]
        return len(reduced), float(sum(reduced))
    if name in _PRODUCT and len(ins) > 1:
        total = float(sum(ins))
        return len(ins), len(ins) * (out + total)
    return 1, out + 2 * float(op.bytes_read)


def _issue(device: DeviceSpec, kernel_s: float, kernels: int = 1) -> float:
    """Seconds ``kernels`` launches take: each its device time plus the per-kernel overhead,
    and no less than the host's time to issue it."""
    per = kernel_s / kernels + device.kernel_overhead_s
    return kernels * max(per, device.dispatch_overhead_s)


def kernel_seconds(device: DeviceSpec, kernel_s: float, kernels: int = 1) -> float:
    """Seconds ``kernels`` launches of ``kernel_s`` device time in all take (see ``_issue``):
    for pricing kernels the graph does not hold one op each (fused regions, casts)."""
    return _issue(device, kernel_s, kernels)


def _fused_attention_seconds(op: OpNode, device: DeviceSpec, peak: float, flops: float,
                             memory_time: float, backward: bool, kv_blocks: int = 1) -> float:
    """Device seconds of a fused attention kernel; ``kv_blocks`` > 1 runs it as that many
    kernels, each over one block of the keys (ring attention's steps): a query tile visits
    ``1 / kv_blocks`` of the keys per kernel, so each ramps up on fewer of them."""
    _, s_k, causal = attention_shape(op)
    work = flops * (0.5 if causal else 1.0)
    keys = (s_k / 2 if causal else s_k) / kv_blocks
    if backward:
        work *= ATTENTION_BACKWARD_FLOPS
    return max(work / (peak * attention_efficiency(device, keys, backward)), memory_time)


def op_time(op: OpNode, device: DeviceSpec, dtype: str, flop_scale: float, byte_scale: float,
            divisor: float = 1.0, sustained: bool = True, kv_blocks: int = 1) -> float:
    """Forward seconds of one op on one device.

    ``flop_scale`` rescales the captured batch to the micro-batch; ``byte_scale`` also converts
    the captured dtype to the compute dtype; ``divisor`` is how many ways the op is split
    (tensor / sequence / expert parallel). ``sustained=False`` prices a single burst at boost
    clock (a benchmark of one kernel) instead of a training loop at the power limit.
    ``kv_blocks`` splits a fused attention into one kernel per block of keys (ring context
    parallelism runs one per ring step).
    """
    if op.kind is OpKind.VIEW:
        return 0.0
    flops = op.flops * flop_scale / divisor
    nbytes = (op.bytes_read + op.bytes_written) * byte_scale / divisor
    dtype = kernel_dtype(op, dtype)
    peak = device.flops_for(dtype)
    memory_time = nbytes / (device.memory_bandwidth * device.efficiency.memory)
    if is_gemm(op):
        m, n, k = matmul_dims(op)
        eff = matmul_efficiency(device, m * flop_scale, n / divisor, k, sustained, dtype)
        seconds = max(flops / (peak * eff), memory_time)
    elif is_fused_attention(op):
        return _issue(device, _fused_attention_seconds(op, device, peak, flops, memory_time,
                                                       False, kv_blocks), kv_blocks)
    elif op.kind is OpKind.ATTENTION:
        clock = device.efficiency.sustained if sustained else 1.0
        seconds = max(flops / (peak * device.efficiency.attention * clock), memory_time)
    else:
        seconds = max(flops / (peak * device.efficiency.memory), memory_time)
    return _issue(device, seconds)


def op_backward_time(op: OpNode, device: DeviceSpec, dtype: str, flop_scale: float,
                     byte_scale: float, divisor: float = 1.0, weight_grad: bool = True,
                     kv_blocks: int = 1) -> float:
    """Backward seconds of one op on one device (arguments as :func:`op_time`).

    A matmul runs its input-gradient matmul and, with ``weight_grad`` (a trainable weight,
    or a matmul of two activations), its weight-gradient matmul, each at its own shape; fused
    attention its backward kernel; a memory-bound op moves its output gradient, its saved
    inputs and its input gradients.
    """
    if op.kind is OpKind.VIEW:
        return 0.0
    flops = op.flops * flop_scale / divisor
    dtype = kernel_dtype(op, dtype)
    peak = device.flops_for(dtype)
    read = op.bytes_read * byte_scale / divisor
    written = op.bytes_written * byte_scale / divisor
    bandwidth = device.memory_bandwidth * device.efficiency.memory
    memory_time = (2 * read + written) / bandwidth
    if is_gemm(op):
        m, n, k = matmul_dims(op)
        rows, cols = m * flop_scale, n / divisor
        # input gradient: (m x n) @ (n x k); weight gradient: (n x m) @ (m x k)
        shapes = [(rows, k, cols)]
        if weight_grad or op.kind is OpKind.MATMUL:
            shapes.append((cols, k, rows))
        return sum(_issue(device, max(flops / (peak * matmul_efficiency(device, a, b, c,
                                                                        dtype=dtype)),
                                      memory_time / len(shapes)))
                   for a, b, c in shapes)
    if is_fused_attention(op):
        return _issue(device, _fused_attention_seconds(op, device, peak, flops, memory_time,
                                                       True, kv_blocks), kv_blocks)
    if op.kind is OpKind.ATTENTION:  # an unfused attention matmul: two matmuls back
        seconds = flops / (peak * device.efficiency.attention * device.efficiency.sustained)
        return _issue(device, 2 * max(seconds, memory_time / 2), kernels=2)
    kernels, nbytes = backward_kernels(op)
    if kernels == 0:
        return 0.0
    seconds = nbytes * byte_scale / divisor / bandwidth
    return _issue(device, max(flops / (peak * device.efficiency.memory), seconds), kernels)
