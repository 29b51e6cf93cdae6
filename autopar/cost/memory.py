"""Model-state memory (parameters, gradients, optimizer) under ZeRO, and the memory breakdown.

ZeRO (Rajbhandari et al., SC20), per device with Psi parameters, N_d data-parallel ranks and
K optimizer bytes per parameter: stage 0 keeps (2 + 2 + K) Psi; stage 1 splits the optimizer
states (2 Psi + 2 Psi + K Psi / N_d); stage 2 the gradients too (2 Psi + (2 + K) Psi / N_d);
stage 3 everything ((2 + 2 + K) Psi / N_d).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from autopar.cost.engines import TORCH_FSDP_ENGINES
from autopar.cost.offload import STATE_OFFLOADS
from autopar.cost.precision import state_bytes

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


def shards_master_weights(config: ParallelConfig) -> bool:
    """Whether the plan's ZeRO-2 holds the parameters sharded as ZeRO-3 does: autopar's
    runtime runs ZeRO-2 as fully_shard without resharding after the forward, so the fp32
    master parameters stay sharded and only the gathered compute copy is whole (from the
    forward to the end of the backward); DeepSpeed's and Megatron-LM's ZeRO-2 keep whole
    parameters. Llama 3's 4D setup is the same FSDP, and llm-foundry's FSDP1 SHARD_GRAD_OP
    keeps its fp32 flat parameters sharded too."""
    return config.engine in TORCH_FSDP_ENGINES and config.zero_stage == 2


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


# torch.optim.AdamW's default path for CPU tensors (``_single_tensor_adam`` in
# torch/optim/adam.py, decoupled weight decay, no amsgrad) makes five elementwise passes over
# fp32 tensors per parameter: param.mul_ (read 4 + write 4 bytes), exp_avg.lerp_ (8 + 4),
# exp_avg_sq.mul_ then addcmul_ (8 + 12), sqrt, div and add_ of the denominator (3 x 8) and
# param.addcdiv_ (12 + 4): 80 bytes of DRAM traffic per parameter, memory-bound on the host
HOST_ADAMW_BYTES_PER_PARAM = 80.0


def optimizer_step_time(memory: MemoryBreakdown, device: DeviceSpec,
                        precision: Precision) -> float:
    """AdamW on the device reads and writes parameters, gradients and states once
    (memory-bound); fp16 loss scaling adds one more read of the gradients (unscale and the
    overflow check). States that live on the host are not in ``memory``: their step is
    :func:`host_optimizer_step_time`."""
    state_bytes = memory.params + memory.grads + memory.optimizer
    passes = 2 * state_bytes + (memory.grads if precision.loss_scaling else 0.0)
    return passes / (device.memory_bandwidth * device.efficiency.memory)


def host_optimizer_step_time(params_per_device: float, cluster: Cluster) -> float:
    """Seconds of the AdamW step that runs on the host CPU for ``params_per_device`` fp32
    parameters of every device of a node: all of the node's devices step at once, so each
    gets its share of the host's DRAM bandwidth (and of its cores: with fewer cores than
    devices the steps queue for them)."""
    node = cluster.node
    assert node is not None
    share = node.host_memory_bandwidth / node.devices_per_node
    share *= min(1.0, node.host_cores / node.devices_per_node)
    return params_per_device * HOST_ADAMW_BYTES_PER_PARAM / share


def host_states(offload: frozenset[str] | set[str], engine: str, train: bool = True
                ) -> frozenset[str]:
    """The model states (of "params", "grads", "optimizer") an offload set keeps in host
    memory. autopar's runtime offloads "optimizer" or "params" with FSDP2's
    ``CPUOffloadPolicy``, which holds the sharded parameters, their gradients and the
    optimizer states on the host and runs the optimizer step there (the same for either
    name). DeepSpeed (exported plans): ZeRO-Offload moves the optimizer states and their step
    to the host; "params" (ZeRO-Infinity) the parameters too. Inference moves parameters."""
    if not train:
        return frozenset({"params"}) & frozenset(offload)
    if engine == "autopar":
        return frozenset({"params", "grads", "optimizer"}) if STATE_OFFLOADS & set(offload) \
            else frozenset()
    return frozenset(offload) & STATE_OFFLOADS


def fully_sharded_states(config: ParallelConfig, mem: MemoryBreakdown, blocks: list
                         ) -> MemoryBreakdown:
    """The model states ``mem`` holds, sharded as fully_shard shards them whatever the ZeRO
    stage (dense over dp x ep ranks, experts over dp): what CPUOffloadPolicy keeps on the
    host. Without ``blocks`` (a lower bound) every state is taken over dp x ep."""
    precision = config.precision
    assert precision is not None
    nd = max(config.dp * config.ep, 1)
    if not blocks:
        zero = config.zero_stage
        return MemoryBreakdown(params=mem.params / (1 if zero >= 3 else nd),
                               grads=mem.grads / (1 if zero >= 2 else nd),
                               optimizer=mem.optimizer / (1 if zero >= 1 else nd))
    param_b, grad_b, optim_b, _ = state_bytes(precision, config.engine)
    out = MemoryBreakdown()
    for numel, n, trains in (
            (sum(c.dense_params * k for c, k in blocks), nd,
             sum(c.trainable_dense * k for c, k in blocks)),
            (sum(c.expert_params * k for c, k in blocks), max(config.dp, 1),
             sum(c.trainable_expert * k for c, k in blocks))):
        states = model_state_bytes(numel, n, 3, param_b, grad_b, optim_b, trains,
                                   frozen_param_bytes=precision.param_bytes)
        out.params += states.params
        out.grads += states.grads
        out.optimizer += states.optimizer
    return out


def offload_transfer(config: ParallelConfig, mem: MemoryBreakdown, blocks: list,
                     num_microbatches: int, cluster: Cluster, train: bool,
                     held: float) -> tuple[float, float]:
    """Move offloaded state from ``mem`` to the host; return (host bytes, exposed seconds,
    the host's optimizer step included).

    autopar's runtime ("optimizer" or "params", FSDP2's CPUOffloadPolicy): the sharded
    parameters, gradients and optimizer states live on the host; every all-gather first
    copies its shard up (each micro-batch's forward, and its backward again under ZeRO-3,
    which reshards after the forward), every micro-batch's reduce-scatter copies its gradient
    shard down, and AdamW steps on the host CPU (:func:`host_optimizer_step_time`). The
    device keeps only what it gathers: one block and its prefetch under ZeRO-3, every block's
    compute copy otherwise (reshard_after_forward=False), and one block's unsharded gradient.
    DeepSpeed's ZeRO-Offload ("optimizer"): gradients go down and updated parameters come
    back once per step, the step on the host. Parameter offload of an inference plan or of
    DeepSpeed (ZeRO-Infinity): every micro-batch streams the parameters up for the forward
    and the backward. Activation offload (save_on_cpu): every saved activation goes down in
    the forward and back in the backward. Streams hide behind compute as far as the device's
    overlap allows (half at best: the first and last transfers are always exposed); the host
    step does not (it runs after the backward). ``blocks`` are the stage's distinct block
    costs (``dense_params``, ``expert_params``, ``activation_bytes``) with how many blocks
    have each.
    """
    precision = config.precision
    assert precision is not None
    bandwidth = cluster.node.host_bandwidth
    hidden = 0.5 * cluster.device.overlap.concurrent
    host = seconds = 0.0
    states = host_states(config.offload, config.engine, train)
    largest = max((c.dense_params + c.expert_params for c, _ in blocks), default=0.0)
    if train and config.engine == "autopar" and states:
        on_host = fully_sharded_states(config, mem, blocks)
        host += on_host.params + on_host.grads + on_host.optimizer
        gathers = 2 if config.zero_stage >= 3 else 1
        streamed = (on_host.params * gathers + on_host.grads) * num_microbatches
        seconds += streamed / bandwidth * (1 - hidden)
        trained = on_host.optimizer / max(state_bytes(precision, config.engine)[2], 1)
        seconds += host_optimizer_step_time(trained, cluster)
        if blocks and config.zero_stage < 2:
            # one device: reshard_after_forward=False keeps every block's gathered parameters
            # from the forward to the end of the backward; the compute copy of trained weights
            # is in the buffers already where the parameter dtype differs from the fp32 master
            # (ZeRO-2 counts the gathered copy with its states: shards_master_weights)
            dense = sum((c.dense_params + c.expert_params) * k for c, k in blocks)
            trains = sum((c.trainable_dense + c.trainable_expert) * k for c, k in blocks)
            copy_b = state_bytes(precision, config.engine)[3]
            mem.buffers += (dense - trains) * precision.param_bytes + (
                0.0 if copy_b else trains * precision.param_bytes)
        mem.buffers += largest * precision.grad_bytes  # one block's unsharded gradient
        mem.params = mem.grads = mem.optimizer = 0.0
    elif train and "optimizer" in states:
        local = mem.optimizer / max(precision.optimizer_bytes, 1)
        host += mem.optimizer
        seconds += local * (precision.grad_bytes + precision.param_bytes) / bandwidth
        seconds += host_optimizer_step_time(local, cluster)
        mem.optimizer = 0.0
    if "params" in states and not (train and config.engine == "autopar"):
        host += mem.params
        streamed = mem.params * (2 if train else 1) * num_microbatches
        mem.params = largest * precision.param_bytes
        seconds += streamed / bandwidth * (1 - hidden)
    if train and "activations" in config.offload:
        stored = sum(c.activation_bytes * k for c, k in blocks)
        host += stored * max(held - 1.0, 0.0)
        seconds += 2 * stored * num_microbatches / bandwidth * (1 - hidden)
    return host, seconds

