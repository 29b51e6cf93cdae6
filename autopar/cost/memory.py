"""Model-state memory (parameters, gradients, optimizer) under ZeRO, and the memory breakdown.

ZeRO (Rajbhandari et al., SC20), per device with Psi parameters, N_d data-parallel ranks and
K optimizer bytes per parameter: stage 0 keeps (2 + 2 + K) Psi; stage 1 splits the optimizer
states (2 Psi + 2 Psi + K Psi / N_d); stage 2 the gradients too (2 Psi + (2 + K) Psi / N_d);
stage 3 everything ((2 + 2 + K) Psi / N_d).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from autopar.cost.config import ParallelConfig
    from autopar.cost.hardware import Cluster, DeviceSpec
    from autopar.cost.precision import Precision


@dataclass
class MemoryBreakdown:
    """Bytes on one device."""

    params: float = 0.0
    grads: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0
    kv_cache: float = 0.0
    buffers: float = 0.0

    @property
    def total(self) -> float:
        return (self.params + self.grads + self.optimizer + self.activations + self.kv_cache
                + self.buffers)

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), "total": self.total}


def model_state_bytes(
    num_params: float,
    data_parallel: int,
    zero_stage: int,
    param_bytes: int = 2,
    grad_bytes: int = 2,
    optimizer_bytes: int = 12,
    trainable: float | None = None,
    frozen_param_bytes: int | None = None,
) -> MemoryBreakdown:
    """Parameters, gradients and optimizer states of ``num_params`` on one device.

    Only the ``trainable`` of them (all by default; fewer when fine-tuning freezes the base
    weights) carry gradients and optimizer states; the frozen ones are held in
    ``frozen_param_bytes`` each (default ``param_bytes``).
    """
    nd = max(data_parallel, 1)
    trainable = num_params if trainable is None else trainable
    frozen_param_bytes = param_bytes if frozen_param_bytes is None else frozen_param_bytes
    params = trainable * param_bytes + (num_params - trainable) * frozen_param_bytes
    grads = trainable * grad_bytes
    optimizer = trainable * optimizer_bytes
    if zero_stage >= 1:
        optimizer /= nd
    if zero_stage >= 2:
        grads /= nd
    if zero_stage >= 3:
        params /= nd
    return MemoryBreakdown(params=params, grads=grads, optimizer=optimizer)


def inflight_microbatches(schedule: str, pp: int, stage: int, num_microbatches: int,
                          virtual_stages: int = 1) -> float:
    """Micro-batches whose activations a stage holds at its peak.

    GPipe keeps all of them; 1F1B and the zero-bubble ZB-H1 schedule keep ``pp - stage``
    (the first stage the most); interleaved 1F1B keeps ``pp`` times
    ``1 + (pp - 1) / (pp * v)`` on the first stage (Narayanan et al. 2021; Korthikanti et al.
    2022), scaled down like 1F1B for later stages.
    """
    m = num_microbatches
    if schedule == "gpipe":
        return float(m)
    held = float(min(pp - stage, m))
    if schedule == "interleaved" and virtual_stages > 1:
        held *= 1 + (pp - 1) / (pp * virtual_stages)
    return held


def optimizer_step_time(memory: MemoryBreakdown, device: DeviceSpec,
                        precision: Precision) -> float:
    """AdamW reads and writes parameters, gradients and states once (memory-bound); fp16
    loss scaling adds one more read of the gradients (unscale and the overflow check)."""
    state_bytes = memory.params + memory.grads + memory.optimizer
    passes = 2 * state_bytes + (memory.grads if precision.loss_scaling else 0.0)
    return passes / (device.memory_bandwidth * device.efficiency.memory)


def offload_transfer(config: ParallelConfig, mem: MemoryBreakdown, blocks: list,
                     num_microbatches: int, cluster: Cluster, train: bool,
                     held: float) -> tuple[float, float]:
    """Move offloaded state from ``mem`` to the host; return (host bytes, exposed seconds).

    Optimizer offload (ZeRO-Offload): gradients go down and updated parameters come back once
    per step. Parameter offload: every micro-batch streams the parameters up for the forward
    and the backward. Activation offload (save_on_cpu): every saved activation goes down in the
    forward and back in the backward. Streams hide behind compute as far as the device's
    overlap allows (half at best: the first and last transfers are always exposed). ``blocks``
    are the stage's distinct block costs (``dense_params``, ``expert_params``,
    ``activation_bytes``) with how many blocks have each.
    """
    precision = config.precision
    assert precision is not None
    bandwidth = cluster.node.host_bandwidth
    hidden = 0.5 * cluster.device.overlap.concurrent
    host = seconds = 0.0
    if train and "optimizer" in config.offload:
        local = mem.optimizer / max(precision.optimizer_bytes, 1)
        host += mem.optimizer
        seconds += local * (precision.grad_bytes + precision.param_bytes) / bandwidth
        mem.optimizer = 0.0
    if "params" in config.offload:
        host += mem.params
        streamed = mem.params * (2 if train else 1) * num_microbatches
        if blocks:
            mem.params = max(c.dense_params + c.expert_params for c, _ in blocks) * \
                precision.param_bytes
        else:
            mem.params = 0.0
        seconds += streamed / bandwidth * (1 - hidden)
    if train and "activations" in config.offload:
        stored = sum(c.activation_bytes * k for c, k in blocks)
        host += stored * max(held - 1.0, 0.0)
        seconds += 2 * stored * num_microbatches / bandwidth * (1 - hidden)
    return host, seconds
