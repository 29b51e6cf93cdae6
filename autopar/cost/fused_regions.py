"""Memory-bound ops as a fusing engine runs them: one kernel per region.

Megatron-LM and Megatron-Core do not run a norm, a rotary embedding or a gated activation as
the chain of eager kernels a Hugging Face module captures into (an RMSNorm is eight: upcast,
square, mean, add, rsqrt, multiply, downcast, scale): they run one fused kernel each
(Transformer Engine's or Apex's fused normalization, ``--apply-rope-fusion``,
``--bias-swiglu-fusion``; NVIDIA/Megatron-LM ``megatron/core/fusions/``). Such a kernel reads
the region's inputs once and writes its outputs once; intermediates (the fp32 upcast, the
squares) never reach memory.

A region is a connected set of memory-bound ops (elementwise, norm) of one module, joined
directly or through views; its forward is one kernel moving the bytes of its distinct
external inputs and of its outputs used outside it, its backward one kernel reading the
output gradients and the saved inputs and writing the input gradients (``2 x inputs +
outputs``, as :func:`autopar.cost.compute.backward_kernels` prices any other op).
"""

from __future__ import annotations

from autopar.cost.compute import kernel_seconds
from autopar.cost.hardware import DeviceSpec
from autopar.ir.graph import Block, Graph, OpKind

_FUSABLE = (OpKind.ELEMENTWISE, OpKind.NORM)


def fused_regions(graph: Graph, block: Block) -> list[list[str]]:
    """The regions of two or more memory-bound ops of one module in ``block`` (a region of
    one op is priced as that op already is)."""
    members = {n for n in block.nodes
               if graph.op(n).kind in (*_FUSABLE, OpKind.VIEW) and graph.op(n).module_path}
    parent = {n: n for n in members}

    def find(n: str) -> str:
        while parent[n] != n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for n in members:
        op = graph.op(n)
        for i in op.inputs:
            if i in members and graph.op(i).module_path == op.module_path:
                parent[find(n)] = find(i)
    groups: dict[str, list[str]] = {}
    for n in block.nodes:  # block order: each region lists its ops in execution order
        if n in members:
            groups.setdefault(find(n), []).append(n)
    consumers = _consumers(graph, block)
    return [ops for ops in groups.values()
            if sum(graph.op(n).kind in _FUSABLE for n in ops) >= 2
            and not _feeds_itself(graph, ops, consumers)]


def _consumers(graph: Graph, block: Block) -> dict[str, list[str]]:
    users: dict[str, list[str]] = {}
    for n in block.nodes:
        for i in graph.op(n).inputs:
            users.setdefault(i, []).append(n)
    return users


def _feeds_itself(graph: Graph, region: list[str], consumers: dict[str, list[str]]) -> bool:
    """Whether an op outside the region both depends on it and feeds it (two residual adds
    with a sub-layer between them): such ops cannot run as one kernel."""
    inside = set(region)
    downstream: set[str] = set()
    frontier = [u for n in region for u in consumers.get(n, []) if u not in inside]
    while frontier:
        n = frontier.pop()
        if n not in downstream:
            downstream.add(n)
            frontier.extend(u for u in consumers.get(n, []) if u not in inside)
    return any(i in downstream for n in region for i in graph.op(n).inputs)


def region_bytes(graph: Graph, block: Block, region: list[str]) -> tuple[float, float]:
    """(bytes of the distinct external inputs, bytes of the outputs used outside) of one
    region, at the captured size; an input reached through views is read once."""
    inside = set(region)
    consumers = _consumers(graph, block)

    def root(name: str) -> str:
        while name in inside and graph.op(name).kind is OpKind.VIEW and graph.op(name).inputs:
            name = graph.op(name).inputs[0]
        return name

    def used_outside(name: str) -> bool:
        users = consumers.get(name, [])
        if not users:
            return True  # a block output
        return any(u not in inside or (graph.op(u).kind is OpKind.VIEW and used_outside(u))
                   for u in users)

    inputs: dict[str, float] = {}
    outputs = 0.0
    for n in region:
        op = graph.op(n)
        if op.kind is OpKind.VIEW:
            continue
        for i, meta in zip(op.inputs, op.input_meta, strict=False):
            source = root(i)
            if source not in inside:
                inputs[source] = max(inputs.get(source, 0.0), float(meta.nbytes))
        if used_outside(n):
            outputs += float(op.bytes_written)
    return sum(inputs.values()), outputs


def fused_region_seconds(graph: Graph, block: Block, region: list[str], device: DeviceSpec,
                         byte_scale: float, divisor: float) -> tuple[float, float]:
    """(forward, backward) seconds of one region run as one fused kernel each way."""
    ins, outs = region_bytes(graph, block, region)
    bandwidth = device.memory_bandwidth * device.efficiency.memory
    scale = byte_scale / divisor
    forward = kernel_seconds(device, (ins + outs) * scale / bandwidth)
    backward = kernel_seconds(device, (2 * ins + outs) * scale / bandwidth)
    return forward, backward
