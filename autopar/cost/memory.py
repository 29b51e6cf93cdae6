"""Model-state memory (parameters, gradients, optimizer) under ZeRO, and the memory breakdown.

ZeRO (Rajbhandari et al., SC20), per device with Psi parameters, N_d data-parallel ranks and
K optimizer bytes per parameter: stage 0 keeps (2 + 2 + K) Psi; stage 1 splits the optimizer
states (2 Psi + 2 Psi + K Psi / N_d); stage 2 the gradients too (2 Psi + (2 + K) Psi / N_d);
stage 3 everything ((2 + 2 + K) Psi / N_d).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


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
    trainable_fraction: float = 1.0,
) -> MemoryBreakdown:
    """Parameters, gradients and optimizer states of ``num_params`` on one device.

    Only trainable parameters carry gradients and optimizer states.
    """
    nd = max(data_parallel, 1)
    trainable = num_params * trainable_fraction
    params = num_params * param_bytes
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
