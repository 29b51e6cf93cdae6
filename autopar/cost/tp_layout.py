"""Megatron-style tensor-parallel layout of a block, read off the graph's dataflow.

Walking a block in execution order with a replicated/sharded state per value: a linear whose
input is replicated is column-parallel (its output is split across the tp ranks); a linear
whose input is already split is row-parallel (its output is a partial sum, all-reduced back to
replicated). Every other op passes the split through. This finds q/k/v + o_proj and
fc1 (gate/up) + fc2 (down) pairs in any transformer without knowing module names; the MoE router
stays replicated and experts are left to expert parallelism.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import networkx as nx

from autopar.cost.config import TPLayouts
from autopar.ir.graph import Block, Graph, OpKind
from autopar.ir.latent import LATENT_ATTENTION


@dataclass
class TPLayout:
    column: list[str] = field(default_factory=list)  # column-parallel linears
    row: list[str] = field(default_factory=list)  # row-parallel linears (all-reduce after)
    sharded: set[str] = field(default_factory=set)  # ops whose outputs are split over tp
    kv: dict[str, int] = field(default_factory=dict)  # kv-head-replicated linear -> kv heads


# the Megatron layout is a pure function of the graph: memoised per graph, never written from
# outside (layouts chosen by the search travel in ParallelConfig.tp_layouts)
_cache: weakref.WeakKeyDictionary[Graph, dict[int, TPLayout]] = weakref.WeakKeyDictionary()


def tp_layout(graph: Graph, block: Block, layouts: TPLayouts | None = None) -> TPLayout:
    """The column/row linears and the ops whose outputs tp splits, for one block: the layout
    ``layouts`` gives its block type, else the Megatron layout from the dataflow."""
    chosen = layouts.get(block.type_id) if layouts is not None else None
    if chosen is not None:
        names = block.nodes
        return TPLayout([names[i] for i in chosen.column], [names[i] for i in chosen.row],
                        {names[i] for i in chosen.sharded},
                        {names[i]: heads for i, heads in chosen.kv})
    return megatron_layout(graph, block)


def megatron_layout(graph: Graph, block: Block) -> TPLayout:
    """Column-parallel after a replicated input, row-parallel after a split one."""
    per_graph = _cache.setdefault(graph, {})
    if block.index in per_graph:
        return per_graph[block.index]
    layout = TPLayout()
    split: set[str] = set()
    for name in block.nodes:
        op = graph.op(name)
        inputs_split = any(src in split for src in op.inputs)
        if op.kind is OpKind.LINEAR and op.params and not any(tied(graph, p)
                                                               for p in op.params):
            if inputs_split:
                layout.row.append(name)  # output all-reduced: replicated again
            else:
                layout.column.append(name)
                split.add(name)
        elif op.kind in (OpKind.MOE_ROUTER, OpKind.MOE_EXPERT, OpKind.EMBEDDING):
            continue
        elif inputs_split:
            split.add(name)
    layout.sharded = split
    per_graph[block.index] = layout
    return layout


def broadcast_split(graph: Graph, op_name: str) -> bool:
    """Whether ``op_name`` may split its output over tp from a replicated input: the ``expand``
    that broadcasts latent attention's one-head rotary key to every head
    (:mod:`autopar.ir.latent`). Each rank expands to its own heads; the input's gradient is
    then a per-rank share, summed over the tp ranks in the backward like a column-parallel
    linear's input."""
    op = graph.op(op_name)
    if op.target != "aten.expand.default" or op.module_type not in LATENT_ATTENTION or \
            not op.input_meta or not op.output_meta:
        return False
    src, out = op.input_meta[0].shape, op.output_meta[0].shape
    return len(src) == len(out) == 4 and src[1] == 1 and out[1] > 1


def broadcast_inputs(graph: Graph, block: Block, layout: TPLayout) -> dict[str, int]:
    """Replicated inputs that a split broadcast (:func:`broadcast_split`) reads -> bytes: each
    one's gradient is all-reduced over tp in the backward."""
    out = {}
    for name in block.nodes:
        if name in layout.sharded and broadcast_split(graph, name):
            op = graph.op(name)
            if op.inputs and op.inputs[0] not in layout.sharded:
                out[op.inputs[0]] = op.input_meta[0].nbytes
    return out


def tied(graph: Graph, param: str) -> bool:
    """Whether ``param`` is shared by several modules (a tied embedding and LM head): one
    tensor cannot carry two tensor-parallel layouts, so it stays replicated."""
    info = graph.params.get(param)
    return bool(info is not None and info.aliases)


def vocab_parallel(graph: Graph, op_name: str, tp: int, enabled: bool = True,
                   tied_split: bool = False) -> bool:
    """Whether an embedding lookup splits its table over ``tp`` ranks (vocabulary parallel):
    only when the rows divide evenly, and unless the plan keeps embeddings whole
    (``enabled=False``, MindFormers' ``vocab_emb_dp``); otherwise it stays replicated. A table
    tied to the LM head stays whole unless ``tied_split`` (an engine whose embedding and head
    share one vocabulary shard, :func:`tied_head`)."""
    op = graph.op(op_name)
    if not enabled or op.kind is not OpKind.EMBEDDING or tp <= 1 or not op.params or \
            (tied(graph, op.params[0]) and not tied_split):
        return False
    shape = graph.params[op.params[0]].shape if op.params[0] in graph.params else ()
    return bool(shape) and shape[0] % tp == 0


def tied_head(graph: Graph, op_name: str, tp: int, tied_split: bool) -> bool:
    """Whether a linear reading a tied embedding table (the LM head) computes its vocabulary
    shard on each of ``tp`` ranks: on engines that split the tied table (Megatron-LM's
    ``parallel_lm_logits`` multiplies by the rank's ``VocabParallelEmbedding`` shard, and with
    pipeline stages the last stage holds its own copy of that shard,
    ``initialize_word_embeddings``), with the input gradient all-reduced in the backward."""
    op = graph.op(op_name)
    return (tied_split and tp > 1 and op.kind is OpKind.LINEAR and bool(op.params)
            and any(tied(graph, p) for p in op.params))


def cache_split(graph: Graph, block: Block, layout: TPLayout, tp: int) -> int:
    """How many ways tensor parallelism splits a block's KV cache: tp, or the kv heads when tp
    exceeds them (each rank then holds the one head its query heads read), or 1 when the
    attention stays whole on every rank."""
    if tp <= 1 or not any(graph.op(n).kind is OpKind.ATTENTION and n in layout.sharded
                          for n in block.nodes):
        return 1
    return min(tp, min(layout.kv.values())) if layout.kv else tp


def attention_core(graph: Graph, block: Block) -> set[str]:
    """Ops from each attention module's first attention op (score matmul or fused SDPA) to its
    last (value matmul): what selective recompute recomputes."""
    by_module: dict[str, list[str]] = {}
    for name in block.nodes:
        op = graph.op(name)
        if op.kind is OpKind.ATTENTION:
            by_module.setdefault(op.module_path, []).append(name)
    core: set[str] = set()
    for names in by_module.values():
        first, last = names[0], names[-1]
        core.update({first, last})
        if first != last:
            between = nx.descendants(graph.dag, first) & nx.ancestors(graph.dag, last)
            core.update(n for n in between if n in set(block.nodes))
    return core
