"""What a block's KV cache holds, per captured token.

An ordinary attention caches its keys and values before any grouped-query repetition, split
by tensor parallelism with the heads (:func:`autopar.cost.tp_layout.cache_split`). Latent
attention (DeepSeek-V2's MLA, :mod:`autopar.ir.latent`) caches one compressed latent and one
shared rotary key per token instead, the same on every tensor-parallel rank, and re-expands
them through its up-projection at every decoding step (:func:`latent_up_projection`).
"""

from __future__ import annotations

from autopar.cost.activations import storage_root
from autopar.cost.tp_layout import broadcast_split
from autopar.ir.graph import Block, Graph, OpKind, OpNode
from autopar.ir.latent import LATENT_ATTENTION, latent_cache_width


def _sdpa_ops(graph: Graph, block: Block) -> list[OpNode]:
    return [graph.op(n) for n in block.nodes
            if graph.op(n).kind is OpKind.ATTENTION and len(graph.op(n).inputs) >= 3
            and "scaled_dot" in graph.op(n).target]


def _latent_bytes(graph: Graph, block: Block, attention: OpNode) -> float:
    """The latent and the shared rotary key one latent attention caches: its up-projection's
    input and the input its rotary key is broadcast from."""
    inside = attention.module_path + "."
    total = 0.0
    for name in block.nodes:
        op = graph.op(name)
        if latent_up_projection(graph, op) and op.module_path.startswith(inside):
            total += op.input_meta[0].nbytes
        elif broadcast_split(graph, name) and op.module_path == attention.module_path:
            total += op.input_meta[0].nbytes
    return total


def latent_attention(graph: Graph, op: OpNode) -> bool:
    """Whether ``op`` is the attention of a latent attention module whose cache is its latent."""
    return (op.kind is OpKind.ATTENTION and op.module_type in LATENT_ATTENTION
            and latent_cache_width(graph.model_config) is not None)


def attention_cache_bytes(graph: Graph, block: Block, op: OpNode, kv_split: int) -> float:
    """Bytes of cache one attention op holds for the captured tokens (captured dtype) on one
    tensor-parallel rank: ``kv_split`` divides ordinary keys and values, not a latent."""
    if latent_attention(graph, op):
        return _latent_bytes(graph, block, op)
    total = 0.0
    for i in (1, 2):  # k and v before grouped-query heads are repeated
        root = storage_root(graph, op.inputs[i])
        src = graph.op(root).output_meta[0] if graph.has_op(root) else op.input_meta[i]
        total += min(src.nbytes, op.input_meta[i].nbytes) / kv_split
    return total


def cache_bytes(graph: Graph, block: Block, kv_split: int) -> float:
    """Bytes of cache the block's attention holds for the captured tokens (captured dtype) on
    one tensor-parallel rank."""
    return sum(attention_cache_bytes(graph, block, op, kv_split)
               for op in _sdpa_ops(graph, block))


def latent_up_projection(graph: Graph, op: OpNode) -> bool:
    """Whether ``op`` is latent attention's up-projection (``kv_b_proj``: a linear reading the
    one-head latent [batch, 1, seq, rank]), which a decoding step runs over every cached
    position, not only the new token's."""
    if op.kind is not OpKind.LINEAR or latent_cache_width(graph.model_config) is None or \
            not op.input_meta:
        return False
    shape = op.input_meta[0].shape
    return len(shape) == 4 and shape[1] == 1
