"""Context parallelism: what splitting each sequence over ``cp`` ranks costs attention.

Every cp rank holds ``seq / cp`` tokens of each sequence: its compute and its activations are
``1 / cp`` of the whole sequence's (the block cost divides them). Everything outside attention
is token-wise and needs no exchange; attention needs every earlier key and value, which the
ranks exchange in one of three ways (``ParallelConfig.cp_mode``):

- ``ring`` (Liu, Zaharia, Abbeel 2023, "Ring Attention with Blockwise Transformers", arXiv
  2310.01889, Sec. 3 and Fig. 2): each rank keeps its queries and passes its key/value block to
  the next rank of the cp ring, ``cp - 1`` times per attention forward, computing the
  attention of the block it holds while the next one arrives. The causal mask is balanced as
  Megatron-Core does (Megatron-Core developer guide, "context parallel" page; Llama 3 paper,
  arXiv 2407.21783, Sec. 3.3.2): the sequence is cut in ``2 cp`` chunks and rank ``i`` holds
  chunks ``i`` and ``2 cp - 1 - i``, so each rank does ``1 / cp`` of the attention work, one
  ``cp``-th of it per ring step. The backward passes the key/value block and its gradient
  (dK, dV) around the ring: twice the bytes (TransformerEngine's ``AttnFuncWithCPAndKVP2P``,
  the kernel behind Megatron-Core's ``cp_comm_type="p2p"``). A step's transfer hides under
  the step's attention compute when it is shorter (the paper's overlap condition) and is
  exposed by what it exceeds it; hidden transfer still slows the compute beside it by the
  device's ``compute_slowdown``.
- ``alltoall`` (Jacobs et al. 2023, "DeepSpeed Ulysses", arXiv 2309.14509, Sec. 3.1): the
  q, k and v projections are re-sharded from sequence to heads by one all-to-all each before
  attention and the output back by a fourth, in the forward; the backward runs the same four
  on the gradients. They sit on attention's critical path (nothing else to overlap). Each
  rank must get whole heads: the query heads and the key/value heads of a tensor-parallel
  rank must both divide by ``cp`` (DeepSpeed-Ulysses' head-count requirement, and
  Megatron-Core's for ``cp_comm_type="a2a"``).
- ``hybrid`` (Megatron-Core ``cp_comm_type="a2a+p2p"``, hierarchical context parallelism):
  all-to-all among the cp ranks inside a node, a ring across nodes over the rest.
- ``allgather`` (Llama 3 paper, arXiv 2407.21783, Sec. 3.3.2; Megatron-Core
  ``cp_comm_type="all_gather"``): the keys and values of the whole sequence are all-gathered
  over the cp ranks before attention and their gradients reduce-scattered after its backward;
  the paper states this latency is exposed on the critical path (small under grouped-query
  attention, whose K/V are few heads).

A ring also changes the attention kernels themselves: each step runs the fused kernel on the
block of keys the rank holds then, so the attention runs as ``ring`` kernels whose query tiles
visit ``1 / ring`` of the keys each (the block cost prices them so: ``ring_blocks``), and each
step's partial output is folded into the running one by its log-sum-exp (the backward adds
each step's dQ to the running one and each arriving dK/dV to the local ones), memory-bound
passes the unsplit kernel does not make (``ring_merge_seconds``; TransformerEngine's
``AttnFuncWithCPAndKVP2P`` corrects the output per step the same way). At a few thousand tokens
these cost more than the exchange itself: a 2,048-token sequence over a ring of 2 runs kernels
over 512 keys, which reach two thirds of the rate 1,024 keys reach.

Gradients of the replicated parameters are reduced over ``dp x cp`` (the data-parallel
collectives' group includes cp: see ``ParallelConfig.dense_replicas``), as torchtitan's
``dp_shard_cp`` mesh does.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.cost.activations import storage_root
from autopar.cost.comm import (
    AxisPlacement,
    axis_collective_time,
    axis_placement,
    collective_time,
    p2p_link_time,
)
from autopar.cost.compute import kernel_seconds
from autopar.cost.config import ParallelConfig
from autopar.cost.data_parallel import overlapped
from autopar.cost.engines import engine_features
from autopar.cost.hardware import Cluster
from autopar.ir.graph import Block, Graph, OpKind


@dataclass(frozen=True)
class AttentionTensors:
    """One attention's q, k, v and output bytes at the captured batch and sequence, whole
    (before any split), with its query and key/value head counts."""

    q_bytes: float
    k_bytes: float  # before any grouped-query repetition
    v_bytes: float
    out_bytes: float
    heads: int
    kv_heads: int


@dataclass(frozen=True)
class ContextParallelComm:
    """A block's context-parallel communication on one device, one micro-batch: the seconds
    it adds to the forward and to the backward after overlap, and before it."""

    fwd_exposed_s: float = 0.0
    bwd_exposed_s: float = 0.0
    fwd_comm_s: float = 0.0
    bwd_comm_s: float = 0.0


def attention_tensors(graph: Graph, block: Block) -> list[AttentionTensors]:
    """The fused attentions (``scaled_dot_product_attention``) of a block, with what context
    parallelism exchanges of each."""
    out = []
    for name in block.nodes:
        op = graph.op(name)
        if op.kind is not OpKind.ATTENTION or len(op.inputs) < 3 or \
                len(op.input_meta[0].shape) != 4:
            continue
        kv = []
        for i in (1, 2):  # k and v before grouped-query heads are repeated
            root = storage_root(graph, op.inputs[i])
            src = graph.op(root).output_meta[0] if graph.has_op(root) else op.input_meta[i]
            own = op.input_meta[i]
            heads = src.shape[1] if len(src.shape) == 4 and src.nbytes <= own.nbytes \
                else own.shape[1]
            kv.append((min(src.nbytes, own.nbytes), heads))
        out_bytes = op.output_meta[0].nbytes if op.output_meta else op.input_meta[0].nbytes
        out.append(AttentionTensors(op.input_meta[0].nbytes, kv[0][0], kv[1][0], out_bytes,
                                    op.input_meta[0].shape[1], kv[0][1]))
    return out


def ulysses_refusal(heads: int, kv_heads: int, tp: int, degree: int,
                    replicate_kv: bool = False) -> str | None:
    """Why an all-to-all over ``degree`` cp ranks cannot give each rank whole heads of a
    tensor-parallel rank's ``heads / tp`` query and ``kv_heads / tp`` key/value heads, or
    None when it can. With ``replicate_kv`` (an engine that repeats the key/value heads per
    query head first: :func:`kv_replication`) only the query heads must divide."""
    if degree <= 1:
        return None
    q_local = heads // tp if heads % tp == 0 else heads
    kv_local = kv_heads // tp if kv_heads % tp == 0 else kv_heads
    if q_local % degree or (kv_local % degree and not replicate_kv):
        return (f"all-to-all context parallelism over {degree} ranks needs the query and "
                f"key/value heads of each tp rank ({q_local} and {kv_local} at tp={tp}) "
                f"divisible by {degree}")
    return None


def kv_replication(heads: int, kv_heads: int, tp: int, degree: int,
                   replicate_kv: bool) -> float:
    """How many times larger the keys and values an all-to-all over ``degree`` ranks moves
    are than the model's: the query heads per key/value head when the key/value heads of a tp
    rank do not divide ``degree`` and the engine repeats them per query head, else 1."""
    q_local = heads // tp if heads % tp == 0 else heads
    kv_local = kv_heads // tp if kv_heads % tp == 0 else kv_heads
    if degree <= 1 or not replicate_kv or kv_local % degree == 0:
        return 1.0
    return q_local / kv_local


def all_to_all_ranks(cp: int, cp_mode: str, tp: int, ep: int, devices_per_node: int) -> int:
    """Ranks each all-to-all spans: cp (alltoall), the cp ranks of one node (hybrid: they sit
    ``tp x ep`` apart), 1 (ring, allgather)."""
    if cp <= 1 or cp_mode in ("ring", "allgather"):
        return 1
    if cp_mode == "alltoall":
        return cp
    stride = tp * ep
    return 1 if stride >= devices_per_node else max(1, min(cp, devices_per_node // stride))


def all_to_all_degree(config: ParallelConfig, cluster: Cluster) -> int:
    """:func:`all_to_all_ranks` of a configuration on a cluster."""
    return all_to_all_ranks(config.cp, config.cp_mode, config.tp, config.ep,
                            cluster.devices_per_node)


def ring_blocks(config: ParallelConfig, cluster: Cluster) -> int:
    """Ranks of the key/value ring (1: none): cp under ``ring``, the cp ranks left after the
    all-to-all under ``hybrid``, none under ``alltoall`` and ``allgather`` (whole keys)."""
    if config.cp <= 1 or config.cp_mode == "allgather":
        return 1
    return config.cp // all_to_all_degree(config, cluster)


def ring_merge_seconds(graph: Graph, block: Block, config: ParallelConfig, cluster: Cluster,
                       byte_scale: float, kv_split: float) -> tuple[float, float]:
    """(forward, backward) seconds of a ring's per-step merges in one block, one micro-batch
    (arguments as :func:`context_parallel_comm`): each step after the first reads the running
    output and the step's and writes the running one (forward); reads and writes the running
    dQ and the step's, and the arriving dK/dV and the local ones (backward). One kernel per
    step forward, two backward."""
    ring = ring_blocks(config, cluster)
    if ring <= 1:
        return 0.0, 0.0
    device = cluster.device
    bandwidth = device.memory_bandwidth * device.efficiency.memory
    per_rank = byte_scale / config.cp
    steps = ring - 1
    fwd = bwd = 0.0
    for t in attention_tensors(graph, block):
        q_split = config.tp if t.heads % config.tp == 0 else 1
        out = t.out_bytes * per_rank / q_split
        q = t.q_bytes * per_rank / q_split
        kv = (t.k_bytes + t.v_bytes) * per_rank / kv_split
        fwd += kernel_seconds(device, steps * 3 * out / bandwidth, steps)
        bwd += kernel_seconds(device, steps * 3 * (q + kv) / bandwidth, 2 * steps)
    return fwd, bwd


def context_parallel_comm(graph: Graph, block: Block, config: ParallelConfig,
                          cluster: Cluster, byte_scale: float, kv_split: float,
                          attention_fwd_s: float, attention_bwd_s: float,
                          recompute: str) -> ContextParallelComm:
    """The context-parallel communication of one block (see the module docstring).

    ``byte_scale`` rescales captured bytes to the micro-batch in the activation dtype (whole
    sequence); ``kv_split`` is how many ways tensor parallelism splits the key/value heads;
    ``attention_*_s`` are this rank's attention compute seconds (already ``1 / cp`` of the
    sequence's). A recompute that re-runs attention (full, selective) exchanges again; ``op``
    keeps the attention kernel's output and does not."""
    cp = config.cp
    if cp <= 1:
        return ContextParallelComm()
    tensors = attention_tensors(graph, block)
    if not tensors:
        return ContextParallelComm()
    tp = config.tp
    placement = axis_placement(config, "cp", cluster.devices_per_node)
    a2a = all_to_all_degree(config, cluster)
    ring = ring_blocks(config, cluster)
    fwd_comm = bwd_comm = 0.0
    fwd_exposed = bwd_exposed = 0.0
    overlap = cluster.device.overlap
    replicate = engine_features(config.engine).ulysses_replicates_kv
    for t in tensors:
        reason = ulysses_refusal(t.heads, t.kv_heads, tp, a2a, replicate)
        if reason is not None:
            raise ValueError(reason)
        repeat = kv_replication(t.heads, t.kv_heads, tp, a2a, replicate)
        q_split = tp if t.heads % tp == 0 else 1
        per_rank = byte_scale / cp
        kv_bytes = (t.k_bytes + t.v_bytes) * per_rank / kv_split
        if a2a > 1:  # q, k, v and the output re-sharded between sequence and heads
            group = AxisPlacement(a2a, min(a2a, placement.per_node),
                                  -(-a2a // min(a2a, placement.per_node)))
            sizes = (t.q_bytes * per_rank / q_split, t.k_bytes * per_rank / kv_split * repeat,
                     t.v_bytes * per_rank / kv_split * repeat, t.out_bytes * per_rank / q_split)
            seconds = sum(collective_time("all_to_all", b, group, cluster) for b in sizes)
            fwd_comm += seconds
            bwd_comm += seconds
            fwd_exposed += seconds
            bwd_exposed += seconds
        if config.cp_mode == "allgather":  # K/V gathered, dK/dV reduce-scattered: exposed
            gather = axis_collective_time("all_gather", kv_bytes * cp, config, "cp", cluster)
            scatter = axis_collective_time("reduce_scatter", kv_bytes * cp, config, "cp",
                                           cluster)
            fwd_comm += gather
            fwd_exposed += gather
            bwd_comm += gather + scatter  # the backward needs the gathered K/V again
            bwd_exposed += gather + scatter
        if ring > 1:
            # the ring's neighbours sit a node apart when it spans nodes: its slowest hop
            across = placement.nodes > 1
            steps = ring - 1
            send_fwd = p2p_link_time(kv_bytes, across, cluster)
            send_bwd = p2p_link_time(2 * kv_bytes, across, cluster)  # K/V and dK/dV
            # attention work per ring step: this rank's share over the ring's blocks
            share = len(tensors) * ring
            fwd_step, bwd_step = attention_fwd_s / share, attention_bwd_s / share
            fwd_comm += steps * send_fwd
            bwd_comm += steps * send_bwd
            fwd_exposed += steps * (overlapped(fwd_step, send_fwd, overlap) - fwd_step)
            bwd_exposed += steps * (overlapped(bwd_step, send_bwd, overlap) - bwd_step)
    if recompute in ("full", "selective"):  # the recomputed forward exchanges again
        bwd_comm += fwd_comm
        bwd_exposed += fwd_exposed
    return ContextParallelComm(fwd_exposed, bwd_exposed, fwd_comm, bwd_comm)


__all__ = ["AttentionTensors", "ContextParallelComm", "all_to_all_degree", "all_to_all_ranks",
           "attention_tensors", "ring_blocks", "ring_merge_seconds",
           "context_parallel_comm", "kv_replication", "ulysses_refusal"]
