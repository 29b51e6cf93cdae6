"""The cost model: (IR, parallel choice, hardware) -> predicted step time and memory per device."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

from autopar.cost.activations import block_activation_bytes, storage_root
from autopar.cost.comm import axis_collective_time, p2p_time
from autopar.cost.compute import op_time
from autopar.cost.config import ParallelConfig
from autopar.cost.hardware import Cluster, load_cluster
from autopar.cost.memory import MemoryBreakdown, inflight_microbatches, model_state_bytes
from autopar.cost.pipeline import pipeline_step_time
from autopar.cost.tp_layout import attention_core, layout_key, tp_layout
from autopar.ir.graph import Block, Graph, OpKind, dtype_bytes

# Block costs depend on the block's type and a few knobs only; a search asks for the same ones
# thousands of times. Keyed weakly by graph so a dropped graph frees its entries.
_BLOCK_COSTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
DDP_BUCKET_BYTES = 2 * 25e6  # two 25 MB gradient buckets in flight (DDP's bucket_cap_mb default)
_DTYPE_BYTES = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp8": 1}


@dataclass
class BlockCost:
    """One block, one micro-batch, one device."""

    fwd_s: float
    bwd_s: float
    recompute_s: float
    tp_comm_s: float
    ep_comm_s: float
    activation_bytes: float
    recompute_peak_bytes: float
    kv_cache_bytes: float
    dense_params: float  # elements on this device
    expert_params: float
    output_bytes: float  # what a stage boundary after this block sends


@dataclass
class StageCost:
    blocks: tuple[int, int]  # [start, end)
    fwd_s: float  # one micro-batch, incl. exposed tp/ep communication
    bwd_s: float
    compute_s: float  # pure compute of one micro-batch (fwd + bwd + recompute)
    comm_s: float  # tp + ep communication of one micro-batch
    dp_comm_s: float  # gradient / ZeRO communication per step, before overlap
    dp_exposed_s: float
    memory: MemoryBreakdown = field(default_factory=MemoryBreakdown)
    host_bytes: float = 0.0  # offloaded state held in host memory for this device
    offload_s: float = 0.0  # exposed host-link transfer time per step
    weight_grad_s: float = 0.0  # weight-gradient share of the backward (zero-bubble defers it)


@dataclass
class Estimate:
    step_time_s: float
    bubble_s: float
    stages: list[StageCost]
    memory: MemoryBreakdown  # the most loaded device
    model_flops: float  # per step, without recompute (the MFU numerator)
    mfu: float
    tokens_per_s: float
    optimizer_s: float
    offload_s: float
    host_bytes_per_node: float = 0.0

    def fits(self, capacity_bytes: float, host_capacity_bytes: float = float("inf")) -> bool:
        """Every device within ``capacity_bytes`` and the offloaded state within host memory."""
        return (all(s.memory.total <= capacity_bytes for s in self.stages)
                and self.host_bytes_per_node <= host_capacity_bytes)


def _captured_batch(graph: Graph) -> int:
    for inp in graph.inputs:
        if inp.meta.shape:
            return inp.meta.shape[0]
    return 1


def _captured_float_bytes(graph: Graph) -> int:
    for p in graph.params.values():
        if p.dtype.startswith(("float", "bfloat")):
            return dtype_bytes(p.dtype)
    return 4


def balanced_stages(graph: Graph, pp: int) -> tuple[tuple[int, int], ...]:
    """Contiguous split of the blocks into ``pp`` stages minimising the largest stage's FLOPs."""
    w = [b.flops for b in graph.blocks]
    n = len(w)
    if pp > n:
        raise ValueError(f"pp={pp} exceeds the {n} blocks of the model")
    prefix = [0]
    for x in w:
        prefix.append(prefix[-1] + x)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(pp + 1)]
    cut = [[0] * (n + 1) for _ in range(pp + 1)]
    best[0][0] = 0
    for k in range(1, pp + 1):
        for j in range(k, n - (pp - k) + 1):
            for i in range(k - 1, j):
                v = max(best[k - 1][i], prefix[j] - prefix[i])
                if v < best[k][j]:
                    best[k][j], cut[k][j] = v, i
    bounds, j = [], n
    for k in range(pp, 0, -1):
        i = cut[k][j]
        bounds.append((i, j))
        j = i
    return tuple(reversed(bounds))


def block_cost(graph: Graph, block: Block, config: ParallelConfig, cluster: Cluster,
               recompute: str) -> BlockCost:
    device = cluster.device
    tp, sp = config.tp, config.sequence_parallel and config.tp > 1
    flop_scale = config.microbatch_size / _captured_batch(graph)
    byte_scale = flop_scale * _DTYPE_BYTES.get(config.compute_dtype, 2) / _captured_float_bytes(graph)
    layout = tp_layout(graph, block, config.tp)
    fwd = 0.0
    core_s = 0.0
    core = attention_core(graph, block) if recompute == "selective" else set()
    expert_param_names: set[str] = set()
    tp_param_names: set[str] = set()
    for name in block.nodes:
        op = graph.op(name)
        if op.kind is OpKind.MOE_EXPERT:
            divisor = 1.0  # ep moves tokens to experts; per-device expert work is unchanged
            expert_param_names.update(op.params)
        elif name in layout.column or name in layout.row or name in layout.sharded or sp:
            divisor = float(tp)
        elif op.kind is OpKind.EMBEDDING and op.params:
            divisor = 1.0
        else:
            divisor = 1.0
        if name in layout.column or name in layout.row or (op.kind is OpKind.EMBEDDING and tp > 1):
            tp_param_names.update(op.params)
        t = op_time(op, device, config.compute_dtype, flop_scale, byte_scale, divisor)
        fwd += t
        if name in core:
            core_s += t
    bwd = 2 * fwd
    recompute_s = fwd if recompute == "full" else core_s
    # tensor-parallel collectives: forward all-reduce after each row linear, backward all-reduce
    # of each distinct column-linear input (all-gather + reduce-scatter under sequence parallel)
    tp_comm = 0.0
    if tp > 1:
        kinds = ("all_gather", "reduce_scatter") if sp else ("all_reduce",)
        fwd_bytes = [graph.op(n).output_bytes * byte_scale for n in layout.row]
        col_inputs = {graph.op(n).inputs[0]: graph.op(n).input_meta[0].nbytes
                      for n in layout.column if graph.op(n).inputs}
        bwd_bytes = [b * byte_scale for b in col_inputs.values()]
        per = [sum(axis_collective_time(k, b, config, "tp", cluster) for k in kinds)
               for b in fwd_bytes + bwd_bytes]
        tp_comm = sum(per)
        if recompute == "full":
            tp_comm += sum(per[: len(fwd_bytes)])
    ep_comm = 0.0
    if config.ep > 1:
        dispatch = [graph.op(n) for n in block.nodes
                    if graph.op(n).kind is OpKind.MOE_EXPERT and "grouped_mm" in graph.op(n).target]
        if dispatch:
            nbytes = dispatch[0].input_meta[0].nbytes * byte_scale
            ep_comm = 4 * axis_collective_time("all_to_all", nbytes, config, "ep", cluster)
    acts = block_activation_bytes(graph, block, tp=tp, sequence_parallel=sp, recompute=recompute,
                                  scale=byte_scale)
    kv = 0.0
    for name in block.nodes:
        op = graph.op(name)
        if op.kind is OpKind.ATTENTION and len(op.inputs) >= 3 and "scaled_dot" in op.target:
            # the cache holds k and v before grouped-query heads are repeated
            for i in (1, 2):
                root = storage_root(graph, op.inputs[i])
                src = graph.op(root).output_meta[0] if root in graph._by_name else op.input_meta[i]
                kv += min(src.nbytes, op.input_meta[i].nbytes) * byte_scale / tp
    dense = expert = 0.0
    for p in block.params:
        numel = graph.params[p].numel if p in graph.params else 0
        if p in expert_param_names:
            expert += numel / config.ep
        elif p in tp_param_names:
            dense += numel / tp
        else:
            dense += numel
    out_bytes = block.output_bytes * byte_scale / (tp if sp else 1)
    return BlockCost(fwd, bwd, recompute_s, tp_comm, ep_comm, acts.stored_bytes,
                     acts.recompute_peak_bytes, kv, dense, expert, out_bytes)


def cached_block_cost(graph: Graph, index: int, config: ParallelConfig, cluster: Cluster,
                      recompute: str) -> BlockCost:
    """:func:`block_cost`, computed once per block type and the knobs it depends on."""
    block = graph.blocks[index]
    key = (block.type_id, recompute, config.tp, config.sequence_parallel, config.ep,
           config.microbatch_size, config.compute_dtype, cluster.cache_key,
           layout_key(graph, block, config.tp))
    by_type = _BLOCK_COSTS.setdefault(graph, {})
    if key not in by_type:
        by_type[key] = block_cost(graph, block, config, cluster, recompute)
    return by_type[key]


def estimate(graph: Graph, cluster: Cluster | str, config: ParallelConfig,
             task: str = "train") -> Estimate:
    """Predict one optimizer step (train/finetune) or one forward pass (infer)."""
    cluster = load_cluster(cluster)
    device = cluster.device
    stages = config.stages or balanced_stages(graph, config.pp)
    train = task != "infer"
    m = config.num_microbatches
    stage_costs: list[StageCost] = []
    p2p = 0.0
    def cost_of(i: int) -> BlockCost:
        return cached_block_cost(graph, i, config, cluster, config.recompute_of(i))

    for s, (start, end) in enumerate(stages):
        costs = [cost_of(i) for i in range(start, end)]
        fwd = sum(c.fwd_s for c in costs)
        comm_fwd = sum(c.tp_comm_s * (0.5 if train else 1.0) + c.ep_comm_s / 2 for c in costs)
        bwd = sum(c.bwd_s + c.recompute_s for c in costs) if train else 0.0
        comm_bwd = sum(c.tp_comm_s * 0.5 + c.ep_comm_s / 2 for c in costs) if train else 0.0
        dense = sum(c.dense_params for c in costs)
        expert = sum(c.expert_params for c in costs)
        if s < len(stages) - 1:
            p2p = max(p2p, p2p_time(costs[-1].output_bytes, config, cluster))
        mem = MemoryBreakdown()
        if train:
            for numel, n in ((dense, config.dp * config.ep), (expert, config.dp)):
                states = model_state_bytes(numel, n, config.zero_stage, config.param_bytes,
                                           config.grad_bytes, config.optimizer_bytes,
                                           config.trainable_fraction)
                mem.params += states.params
                mem.grads += states.grads
                mem.optimizer += states.optimizer
            held = inflight_microbatches(config.schedule, config.pp, s, m, config.virtual_stages)
            on_device = min(held, 1.0) if "activations" in config.offload else held
            mem.activations = (sum(c.activation_bytes for c in costs) * on_device
                               + max(c.recompute_peak_bytes for c in costs))
        else:
            mem.params = dense * config.param_bytes + expert * config.param_bytes
            mem.kv_cache = sum(c.kv_cache_bytes for c in costs)
            mem.activations = max(c.activation_bytes + c.recompute_peak_bytes for c in costs)
        host_bytes, offload_s = _offload(config, mem, costs, m, cluster, train,
                                         held if train else 1.0)
        if train and config.zero_stage == 3:
            largest = max(c.dense_params + c.expert_params for c in costs)
            mem.buffers += 2 * largest * config.param_bytes  # gathered layer + prefetch
        elif train and config.dp * config.ep > 1:
            mem.buffers += DDP_BUCKET_BYTES
        if end == len(graph.blocks):  # logits in fp32 and their gradient for the loss
            out = sum(graph.op(n).output_bytes for n in graph.outputs if n in graph._by_name)
            mem.buffers += 2 * out * config.microbatch_size / _captured_batch(graph) * (
                4 / _captured_float_bytes(graph)) / config.tp
        # data-parallel traffic: gradients reduced during the backward (reduce-scatter under
        # ZeRO >= 1, all-reduce otherwise); parameters all-gathered after the step (ZeRO 1/2,
        # hidden under the next forward) or before each use (ZeRO-3, forward and backward)
        grad_comm = param_comm = 0.0
        if train:
            for numel, axis in ((dense, "dense_dp"), (expert, "dp")):
                grad_b = numel * config.trainable_fraction * config.grad_bytes
                param_b = numel * config.param_bytes
                if config.zero_stage == 0:
                    grad_comm += axis_collective_time("all_reduce", grad_b, config, axis, cluster)
                    continue
                grad_comm += axis_collective_time("reduce_scatter", grad_b, config, axis, cluster)
                gathers = 2 * m if config.zero_stage == 3 else 1  # re-gathered per micro-batch
                param_comm += gathers * axis_collective_time("all_gather", param_b, config, axis,
                                                             cluster)
        compute = fwd + bwd
        overlap = device.efficiency.overlap
        last = 1 / max(len(costs), 1)  # the last bucket / first gather is always exposed
        # overlap windows are the plain forward/backward: recompute must never look like it
        # hides communication (it only lengthens the critical path)
        base_bwd = sum(c.bwd_s for c in costs) if train else 0.0
        exposed = max(grad_comm - base_bwd * overlap, grad_comm * last)
        window = (fwd + base_bwd) * m if config.zero_stage == 3 else fwd * m
        exposed += max(param_comm - window * overlap, param_comm * last)
        dp_comm = grad_comm + param_comm
        stage_costs.append(StageCost((start, end), fwd + comm_fwd, bwd + comm_bwd, compute,
                                     comm_fwd + comm_bwd, dp_comm, exposed if train else 0.0, mem,
                                     host_bytes, offload_s,
                                     sum(c.bwd_s for c in costs) / 2 if train else 0.0))
    step, bubble = pipeline_step_time([s.fwd_s for s in stage_costs],
                                      [s.bwd_s for s in stage_costs], m, config.schedule,
                                      config.virtual_stages, p2p,
                                      [s.weight_grad_s for s in stage_costs],
                                      device.efficiency.overlap)
    optimizer_s = 0.0
    if train:
        worst = max(stage_costs, key=lambda s: s.memory.params + s.memory.optimizer)
        # AdamW reads and writes params, grads and states once
        state_bytes = worst.memory.params + worst.memory.grads + worst.memory.optimizer
        optimizer_s = 2 * state_bytes / (device.memory_bandwidth * device.efficiency.memory)
    offload_s = max(s.offload_s for s in stage_costs)
    step += max(s.dp_exposed_s for s in stage_costs) + optimizer_s + offload_s
    batch = config.global_batch
    tokens = batch * max(graph.tokens // _captured_batch(graph), 1)
    model_flops = graph.flops * batch / _captured_batch(graph) * (3 if train else 1)
    peak = device.flops_for(config.compute_dtype) * config.devices
    memory = max((s.memory for s in stage_costs), key=lambda mb: mb.total)
    host = max(s.host_bytes for s in stage_costs) * cluster.devices_per_node
    return Estimate(step, bubble, stage_costs, memory, model_flops, model_flops / (step * peak),
                    tokens / step, optimizer_s, offload_s, host)


def _offload(config: ParallelConfig, mem: MemoryBreakdown, costs: list[BlockCost],
             num_microbatches: int, cluster: Cluster, train: bool,
             held: float) -> tuple[float, float]:
    """Move offloaded state from ``mem`` to the host; return (host bytes, exposed seconds).

    Optimizer offload (ZeRO-Offload): gradients go down and updated parameters come back once
    per step. Parameter offload: every micro-batch streams the parameters up for the forward
    and the backward. Activation offload (save_on_cpu): every saved activation goes down in the
    forward and back in the backward. Streams hide behind compute as far as the device's
    overlap allows (half at best: the first and last transfers are always exposed).
    """
    bandwidth = cluster.node.host_bandwidth
    hidden = 0.5 * cluster.device.efficiency.overlap
    host = seconds = 0.0
    if train and "optimizer" in config.offload:
        local = mem.optimizer / max(config.optimizer_bytes, 1)
        host += mem.optimizer
        seconds += local * (config.grad_bytes + config.param_bytes) / bandwidth
        mem.optimizer = 0.0
    if "params" in config.offload:
        host += mem.params
        streamed = mem.params * (2 if train else 1) * num_microbatches
        mem.params = max(c.dense_params + c.expert_params for c in costs) * config.param_bytes
        seconds += streamed / bandwidth * (1 - hidden)
    if train and "activations" in config.offload:
        stored = sum(c.activation_bytes for c in costs)
        host += stored * max(held - 1.0, 0.0)
        seconds += 2 * stored * num_microbatches / bandwidth * (1 - hidden)
    return host, seconds
