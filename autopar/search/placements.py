"""Where each parameter lives under a chosen configuration, read off the graph: what plan.yaml
records and the runtime applies.

Three facts the runtime cannot guess are recorded beside the per-parameter placements:

* ``fused``: a column-parallel projection whose output the model cuts end to end into parts
  (Phi-3's ``qkv_proj`` into q, k and v; ``gate_up_proj`` into gate and up; GPT-2's ``c_attn``)
  lists the parts' sizes. Each rank must hold its share of every part (its own q, k and v
  heads), not a contiguous block of the fused output. A projection whose output is first viewed
  as heads (GPT-NeoX, Falcon's grouped layout) interleaves its parts per head, so a contiguous
  split already gives whole heads and nothing is recorded. An einsum projection's weight is a
  bare parameter beside others of its module (``w_qkv`` next to ``w_o``), so its entry is
  keyed by the parameter's own name, not the module's.
* ``heads``: per attention module, its query heads, key/value heads and head size, so that a
  module whose code reads its head counts (Phi-3 slices ``qkv`` at ``num_heads * head_dim``,
  GPT-2 splits at ``split_size``) can be given the counts of its local heads.
* ``Replicate@tp(kv-heads)``: with fewer key/value heads than tp (GQA, MQA), the key and
  value projections stay whole and each rank computes the kv head of its query heads.
* the weight's orientation: nn.Linear stores (out, in), GPT-2's Conv1D (in, out); a column split
  is ``Shard`` of the output-feature dimension of the stored tensor, whichever it is.
"""

from __future__ import annotations

from autopar.cost.activations import storage_root
from autopar.cost.config import ParallelConfig
from autopar.cost.tp_layout import tp_layout, vocab_parallel
from autopar.ir.graph import Graph, OpKind, OpNode
from autopar.peft import is_prefix_param

_SPLITS = ("split", "split_with_sizes", "chunk", "tensor_split")
# a key/value projection whose attention has fewer kv heads than tp: its weight stays whole on
# every rank, which computes the one kv head its query heads read
KV_REPLICATED = "Replicate@tp(kv-heads)"


def _packet(target: str) -> str:
    parts = str(target).split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "aten" else parts[0]


def weight_param(graph: Graph, op: OpNode) -> str | None:
    """The 2-D weight a linear op reads (its bias is 1-D)."""
    for p in op.params:
        info = graph.params.get(p)
        if info is not None and len(info.shape) == 2:
            return p
    return None


def output_dim(graph: Graph, op: OpNode) -> int:
    """The dimension of the stored weight that indexes output features: 0 for nn.Linear's
    (out, in) (``aten.linear`` transposes it), 1 for a weight multiplied as stored (GPT-2's
    Conv1D in ``addmm(bias, x, weight)``); an einsum projection's is stated by its equation."""
    if op.weight_out_dim is not None:
        return op.weight_out_dim
    return 0 if _packet(op.target) == "linear" else 1


def fused_segments(graph: Graph, name: str) -> list[int] | None:
    """Sizes of the parts a linear's output is cut into along its features, when the model
    cuts it end to end; None when it is used whole or viewed as heads first."""
    op = graph.op(name)
    width = op.output_meta[0].shape[-1]
    value = name
    for _ in range(8):
        users = [graph.op(u) for u in graph.dag.successors(value) if graph.has_op(u)]
        if not users:
            return None
        if all(_packet(u.target) == "slice" and u.output_meta and
               u.output_meta[0].shape[-1] < width for u in users):
            # slices in program order: models cut q, k, v (or gate, up) front to back
            sizes = [u.output_meta[0].shape[-1] for u in users]
            return sizes if sum(sizes) == width else None
        if len(users) == 1 and _packed_parts(graph, users[0], width):
            return _packed_parts(graph, users[0], width)
        if len(users) == 1 and _packet(users[0].target) in _SPLITS:
            sizes = [m.shape[-1] for m in users[0].output_meta]
            return sizes if len(sizes) > 1 and sum(sizes) == width else None
        # through views that keep the features, and elementwise ops on them (LoRA's update
        # added to the base output, which the runtime splits part by part too)
        if len(users) == 1 and users[0].kind in (OpKind.VIEW, OpKind.ELEMENTWISE) and \
                users[0].output_meta and users[0].output_meta[0].shape[-1] == width:
            value = users[0].name
            continue
        return None
    return None


def _packed_parts(graph: Graph, view: OpNode, width: int) -> list[int] | None:
    """nn.MultiheadAttention's packed projection: its output unflattened to ``[..., 3, E]``,
    then moved around and cut by selecting each of the 3 (q, k, v) along that new dimension.
    A heads-first view (GPT-NeoX's ``[..., heads, 3 * head_dim]``) is cut along its last
    dimension instead, so only a select of every part counts."""
    out = view.output_meta[0].shape if view.output_meta else ()
    if view.kind is not OpKind.VIEW or len(out) < 2 or out[-2] * out[-1] != width or \
            out[-1] == width or out[-2] not in (2, 3):
        return None
    count, value = out[-2], view.name
    for _ in range(6):
        users = [graph.op(u) for u in graph.dag.successors(value) if graph.has_op(u)]
        if len(users) == count and all(_packet(u.target) == "select" for u in users):
            return [width // count] * count
        if len(users) != 1 or users[0].kind not in (OpKind.VIEW, OpKind.ELEMENTWISE):
            return None
        value = users[0].name
    return None


def attention_heads(graph: Graph) -> dict[str, list[int]]:
    """Attention module path -> [query heads, key/value heads, head size]."""
    out: dict[str, list[int]] = {}
    for op in graph.ops:
        if op.kind is not OpKind.ATTENTION or len(op.input_meta) < 3 or \
                len(op.input_meta[0].shape) != 4 or not op.module_path:
            continue
        q = op.input_meta[0].shape
        kv = q[1]
        root = storage_root(graph, op.inputs[1])  # before any grouped-query repetition
        meta = graph.op(root).output_meta[0] if graph.has_op(root) else op.input_meta[1]
        if len(meta.shape) == 4 and meta.shape[-1] == q[-1]:  # a (batch, heads, seq, dim)
            kv = meta.shape[1]  # tensor, not a packed projection's storage
        elif len(op.input_meta[1].shape) == 4:
            kv = op.input_meta[1].shape[1]
        out.setdefault(op.module_path, [q[1], kv, q[-1]])
    return out


def placements(graph: Graph, config: ParallelConfig) -> dict:
    """The plan's ``placements``: per-parameter placement strings, the per-node strategies of
    each block type, and (under tp) the fused projections' parts and the attention heads."""
    params: dict[str, str] = {}
    nodes: dict[str, dict[str, str]] = {}
    fused: dict[str, list[int]] = {}
    zero = "+Shard(0)@dp" if config.zero_stage == 3 else ""
    tp = config.tp > 1
    # an expert weight may first be read by a plain indexing op: decide by any expert use
    experts = {p for op in graph.ops if op.kind is OpKind.MOE_EXPERT for p in op.params}
    split_linears: dict[str, str] = {}  # module path -> "column" | "row" (LoRA follows them)
    for block in graph.blocks:
        layout = tp_layout(graph, block, config.tp_layouts)
        per_node = nodes.setdefault(str(block.type_id), {}) if str(block.type_id) not in nodes \
            else None
        for name in block.nodes:
            op = graph.op(name)
            where = {p: "Replicate" for p in op.params}
            if op.kind is OpKind.MOE_EXPERT or (experts and set(op.params) <= experts
                                                 and op.params):
                where = {p: "Shard(0)@ep" if config.ep > 1 else "Replicate" for p in op.params}
            elif tp and name in layout.kv:  # each rank computes one kv head: weights whole
                where = {p: KV_REPLICATED for p in op.params}
            elif tp and (name in layout.column or name in layout.row):
                weight, out_dim = weight_param(graph, op), output_dim(graph, op)
                column = name in layout.column
                split_linears[weight.rsplit(".", 1)[0]] = "column" if column else "row"
                for p in op.params:
                    if p == weight:  # column: output features split; row: input features
                        where[p] = f"Shard({out_dim if column else 1 - out_dim})@tp"
                    elif column:  # a column-parallel bias is split with its outputs
                        where[p] = "Shard(0)@tp"  # (a row-parallel one is added once, whole)
            elif tp and name in layout.sharded and op.params and \
                    all(is_prefix_param(p) for p in op.params):
                where = {p: "Shard(0)@tp" for p in op.params}  # a prefix, split by heads
            elif vocab_parallel(graph, name, config.tp, config.vocab_parallel):
                where = {p: "Shard(0)@tp" for p in op.params}  # vocabulary split
            weight = weight_param(graph, op) if op.kind is OpKind.LINEAR else None
            parts = fused_segments(graph, name) if tp and weight else None
            if parts:  # a model fact, recorded whatever this layout splits
                fused[weight if op.weight_out_dim is not None else
                      weight.rsplit(".", 1)[0]] = parts
            for p, w in where.items():
                if params.get(p, "Replicate") == "Replicate":
                    params[p] = w + zero if w != "Replicate" or not zero else "Shard(0)@dp"
            if per_node is not None:
                if name in layout.kv:
                    per_node[name] = "kv-replicated"
                elif name in layout.column:
                    per_node[name] = "column"
                elif name in layout.row:
                    per_node[name] = "row"
                elif name in layout.sharded:
                    per_node[name] = "split"
    for p in graph.params:
        params.setdefault(p, "Shard(0)@dp" if zero else "Replicate")
    for p in params:  # LoRA on a column linear: B split; on a row linear: A split
        module, _, leaf = p.rpartition(".")
        kind = split_linears.get(module)
        if kind and (leaf, kind) in (("lora_B", "column"), ("lora_A", "row")):
            params[p] = f"Shard({0 if leaf == 'lora_B' else 1})@tp" + zero
    out = {"params": dict(sorted(params.items())), "nodes_by_block_type": nodes}
    if tp:
        out["fused"] = dict(sorted(fused.items()))
        out["heads"] = dict(sorted(attention_heads(graph).items()))
    return out
