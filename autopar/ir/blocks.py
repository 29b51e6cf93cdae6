"""Group ops into blocks: the repeated layers of a model and the parts before and after them.

The layer container is found from module paths: the module path prefix followed by an integer
index (``model.layers.7``, ``transformer.h.7``, ``0`` for a Sequential) that has the most
distinct indices. Ops inside one index form a layer block; ops before the first layer form the
head block, ops after the last one the tail block. Ops at the container's level that sit
between two layers (rare) join the preceding layer. Without any indexed container, contiguous
runs of ops under the same top-level child module become blocks.

Block types come from a structural hash (op targets, kinds, shapes, dtypes and parameter
shapes, with inputs referenced by relative position), so layers that differ only in their
weights share a type id and one solver solution.
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter

from autopar.ir.graph import Block, Graph, OpKind

_INDEX = re.compile(r"^\d+$")
# the names grouping gives blocks that are not one of the repeated layers: the ops before the
# layers, the ops after them, and ops under no module at all. Every reader of a plan's blocks
# (the cost model, pipeline cuts, tensor-parallel layers, exports) tells layers apart by these
LAYERLESS_BLOCKS = ("head", "tail", "root")


def _layer_key(path: str, container: str) -> str | None:
    """``model.layers.3.mlp`` with container ``model.layers`` -> ``model.layers.3``."""
    prefix = container + "." if container else ""
    if not path.startswith(prefix):
        return None
    rest = path[len(prefix):].split(".")
    if rest and _INDEX.match(rest[0]):
        return prefix + rest[0]
    return None


def find_layer_container(paths: list[str]) -> str | None:
    """The module path whose integer-indexed children are most numerous (at least 2)."""
    indices: dict[str, set[str]] = {}
    for path in set(paths):
        parts = path.split(".") if path else []
        for i, part in enumerate(parts):
            if _INDEX.match(part):
                indices.setdefault(".".join(parts[:i]), set()).add(part)
    best = None
    for container, idx in indices.items():
        if len(idx) >= 2 and (best is None or len(idx) > len(indices[best])):
            best = container
    return best


def _structural_hash(graph: Graph, names: list[str]) -> str:
    position = {n: i for i, n in enumerate(names)}
    h = hashlib.sha1()
    for i, name in enumerate(names):
        op = graph.op(name)
        refs = [f"r{i - position[s]}" if s in position else "ext" for s in op.inputs]
        params = [graph.params[p].shape if p in graph.params else () for p in op.params]
        h.update(repr((op.target, op.kind.value, refs,
                       [(m.shape, m.dtype) for m in op.output_meta], params)).encode())
    return h.hexdigest()


def _block_kind(graph: Graph, names: list[str], role: str) -> str:
    kinds = Counter(graph.op(n).kind for n in names)
    if kinds[OpKind.MOE_EXPERT] or kinds[OpKind.MOE_ROUTER]:
        return "moe"
    if kinds[OpKind.ATTENTION]:
        return "transformer"
    if role == "head" and kinds[OpKind.EMBEDDING]:
        return "embedding"
    if role == "tail":
        return "output"
    return "other"


def assign_blocks(graph: Graph) -> None:
    """Fill ``graph.blocks`` and each op's ``block`` index."""
    ops = graph.ops
    container = find_layer_container([op.module_path for op in ops])
    groups: list[tuple[str, str, list[str]]] = []  # (name, role, op names)
    if container is not None:
        current: str | None = None
        head: list[str] = []
        tail: list[str] = []
        layers: dict[str, list[str]] = {}
        order: list[str] = []
        carried: list[int] = []  # ops between consecutive layers, per gap
        for op in ops:
            key = _layer_key(op.module_path, container)
            if key is not None:
                if key not in layers:
                    layers[key] = []
                    order.append(key)
                    if current is not None:
                        layers[current].extend(tail)
                        carried.append(len(tail))
                    else:
                        head.extend(tail)
                    tail = []
                current = key
                layers[key].append(op.name)
            elif current is None:
                head.append(op.name)
            else:
                tail.append(op.name)
        # The last layer gets the same trailing ops the others got (e.g. an activation applied
        # in the parent's loop), so that it keeps the type of its siblings.
        if carried and len(set(carried)) == 1 and carried[0] <= len(tail):
            layers[order[-1]].extend(tail[: carried[0]])
            tail = tail[carried[0]:]
        if head:
            groups.append(("head", "head", head))
        groups.extend((key, "layer", layers[key]) for key in order)
        if tail:
            groups.append(("tail", "tail", tail))
    else:
        run_key: str | None = None
        for op in ops:
            top = op.module_path.split(".")[0] if op.module_path else ""
            if groups and top == run_key:
                groups[-1][2].append(op.name)
            else:
                groups.append((top or "root", "layer", [op.name]))
                run_key = top

    type_ids: dict[str, int] = {}
    blocks: list[Block] = []
    for index, (name, role, names) in enumerate(groups):
        digest = _structural_hash(graph, names)
        type_id = type_ids.setdefault(f"{role}:{digest}", len(type_ids))
        member = set(names)
        params = sorted({p for n in names for p in graph.op(n).params})
        out_bytes = 0
        for n in names:
            if any(succ not in member for succ in graph.dag.successors(n)):
                out_bytes += graph.op(n).output_bytes
        for n in names:
            graph.op(n).block = index
        blocks.append(Block(
            index=index, name=name, role=role, kind=_block_kind(graph, names, role),
            type_id=type_id, nodes=names, params=params,
            flops=sum(graph.op(n).flops for n in names),
            param_numel=sum(graph.params[p].numel for p in params if p in graph.params),
            param_bytes=sum(graph.params[p].nbytes for p in params if p in graph.params),
            output_bytes=out_bytes,
        ))
    graph.blocks = blocks
