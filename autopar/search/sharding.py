"""Per-op tensor-parallel sharding of one block type, solved with OR-Tools CP-SAT.

Every op picks a strategy: a linear is replicated (R), column-parallel (C: replicated input,
split output, its input gradient all-reduced in the backward) or row-parallel (W: split input,
output all-reduced in the forward); ops that can work on split data (elementwise, views,
attention over split heads, softmax) are replicated or split (S); norms, embeddings, routers and
experts stay replicated (experts are expert parallelism's). An edge carries a split value only
into an op that takes split input, except values with no gradient (masks, rotary tables),
which any split op slices for free (and latent attention's shared rotary key, which its
``expand`` broadcasts to each rank's own heads: B, the key's gradient all-reduced in the
backward, :func:`autopar.cost.tp_layout.broadcast_split`); what the next block reads is replicated (the model's final
outputs, the logits, may stay split for a vocabulary-parallel loss). The objective is the
block's forward + backward compute on one device plus the all-reduces the strategies imply
(one per distinct column-parallel input), in integer nanoseconds. One model per block type and
degree; its optimum (CP-SAT proves it) is that type's layout, handed to the cost model inside
the candidate's ParallelConfig (``tp_layouts``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ortools.sat.python import cp_model

from autopar.capture.op_costs import packet_name
from autopar.cost.activations import requires_grad, storage_root
from autopar.cost.comm import axis_collective_time
from autopar.cost.compute import op_backward_time, op_time
from autopar.cost.config import BlockLayout, ParallelConfig, TPLayouts
from autopar.cost.hardware import Cluster
from autopar.cost.precision import DTYPE_BYTES
from autopar.cost.tp_layout import broadcast_split, tied
from autopar.ir.graph import Block, Graph, OpKind, OpNode
from autopar.peft import is_added_param, is_prefix_param
from autopar.search.placements import fused_segments

_REPLICATED_ONLY = (OpKind.NORM, OpKind.EMBEDDING, OpKind.MOE_ROUTER, OpKind.MOE_EXPERT)
_SPLIT_REDUCTIONS = {"softmax", "_softmax", "_safe_softmax", "log_softmax", "_log_softmax"}


@dataclass
class ShardingSolution:
    type_id: int
    tp: int
    status: str  # OPTIMAL / FEASIBLE
    objective_s: float
    bound_s: float
    column: list[int]
    row: list[int]
    sharded: list[int]
    kv: list[tuple[int, int]] = field(default_factory=list)  # (op, kv heads): kv replicated


def kv_projections(graph: Graph, block: Block, tp: int) -> dict[str, int]:
    """Linear ops that make the keys or values of an attention with fewer kv heads than
    ``tp`` (tp a multiple of them, its query heads divisible by tp) -> its kv heads. Such an
    attention splits by query heads, each rank computing the one kv head its queries read
    (Megatron's replicated kv heads)."""
    members = set(block.nodes)
    out: dict[str, int] = {}
    for name in block.nodes:
        op = graph.op(name)
        if op.kind is not OpKind.ATTENTION or len(op.input_meta[0].shape) != 4 or \
                len(op.inputs) < 3:
            continue
        heads = _heads(graph, op)
        q, kv = heads[0], min(heads)
        if q % tp or kv % tp == 0 or tp % kv:
            continue
        for i in (1, 2):  # back from k and v through views and elementwise ops (rotary)
            stack, seen = [op.inputs[i]], set()
            while stack:
                src = stack.pop()
                if src in seen or src not in members:
                    continue
                seen.add(src)
                producer = graph.op(src)
                if producer.kind is OpKind.LINEAR and producer.params:
                    out[src] = kv
                elif producer.kind in (OpKind.VIEW, OpKind.ELEMENTWISE):
                    stack.extend(producer.inputs)
    return out


def moe_region_linears(graph: Graph, block: Block) -> set[str]:
    """Linears inside the module that holds a router (a shared expert beside the routed
    ones): a traced pipeline stage runs a region either split or whole, and the router and
    experts stay whole."""
    regions = {graph.op(n).module_path.rpartition(".")[0] for n in block.nodes
               if graph.op(n).kind is OpKind.MOE_ROUTER}
    return {n for n in block.nodes if graph.op(n).kind is OpKind.LINEAR and any(
        graph.op(n).module_path.startswith(r + ".") for r in regions if r)}


def staged_restrictions(graph: Graph) -> bool:
    """Whether traced pipeline stages need layouts of their own: they run neither a
    broadcast split (latent attention's rotary key) nor a split shared expert beside whole
    routed experts (the stage's DTensor arithmetic would mix in the whole modules' plain
    tensors), so their candidates take layouts solved without them."""
    first = {b.type_id: b for b in reversed(graph.blocks)}
    return any(moe_region_linears(graph, b) or any(broadcast_split(graph, n) for n in b.nodes)
               for b in first.values())


def _strategies(graph: Graph, name: str, tp: int, kv: dict[str, int] | None = None,
                staged: bool = False) -> list[str]:
    op = graph.op(name)
    if op.kind is OpKind.LINEAR and op.params and any(is_added_param(p) for p in op.params):
        leaf = op.params[0].rpartition(".")[2]
        if leaf not in ("lora_A", "lora_B"):
            return ["R"]  # an adapter's bottleneck: whole on every rank
        # a LoRA factor: laid out with its base linear (solve_block ties them): B split with a
        # column base's outputs, A with a row base's inputs
        return ["R", "W" if leaf == "lora_A" else "C"]
    if op.kind is OpKind.LINEAR and op.params and kv and name in kv:
        return ["R", "G"]  # replicated, or its rank's kv head (G)
    if op.kind is OpKind.LINEAR and op.params and any(tied(graph, p) for p in op.params):
        return ["R"]  # a head tied to the embedding: one tensor, one (replicated) layout
    if op.kind is OpKind.LINEAR and op.params:
        out = ["R"]
        # a fused projection (q|k|v, gate|up) splits part by part: every part must divide
        parts = fused_segments(graph, name) or [op.output_meta[0].shape[-1]]
        if all(p % tp == 0 for p in parts):
            out.append("C")
        if op.input_meta and op.input_meta[0].shape[-1] % tp == 0:
            out.append("W")
        return out
    if not staged and broadcast_split(graph, name):
        # latent attention's shared rotary key, expanded to each rank's own heads (B): its
        # gradient summed over the ranks in the backward
        return ["R", "S", "B"]
    if op.params and all(is_prefix_param(p) for p in op.params) and \
            op.kind in (OpKind.VIEW, OpKind.ELEMENTWISE):
        # a Prefix Tuning prefix [kv_heads, tokens, head_dim] on its way into the keys or
        # values: split by heads with the attention when the kv heads divide
        return ["R", "S"] if graph.params[op.params[0]].shape[0] % tp == 0 else ["R"]
    if op.kind in _REPLICATED_ONLY or op.params:
        return ["R"]
    if op.kind is OpKind.REDUCTION and packet_name(op.target) not in _SPLIT_REDUCTIONS:
        return ["R"]
    if op.kind is OpKind.ATTENTION and len(op.input_meta[0].shape) == 4:
        heads = _heads(graph, op)
        q, kv = heads[0], min(heads)
        if q % tp or (kv % tp and tp % kv):
            return ["R"]  # split by whole query heads (kv heads split, or replicated per group)
    return ["R", "S"]


def _heads(graph: Graph, op: OpNode) -> tuple[int, ...]:
    """Query heads, then key/value heads before any grouped-query repetition."""
    heads = [op.input_meta[0].shape[1]]
    for i in (1, 2):
        if i < len(op.inputs):
            root = storage_root(graph, op.inputs[i])
            # a linear's own output is [batch, seq, features] (MLA's up-projection of its
            # one-head latent: [batch, 1, seq, heads x dim]): its dimension 1 counts no heads
            owned = graph.has_op(root) and graph.op(root).kind is not OpKind.LINEAR
            meta = graph.op(root).output_meta[0] if owned else op.input_meta[i]
            if len(meta.shape) == 4:
                heads.append(meta.shape[1])
    return tuple(heads)


def _op_seconds(op: OpNode, strategy: str, tp: int, cluster: Cluster, dtype: str,
                kv_heads: int = 1) -> float:
    """Forward + backward of one op under one strategy, with the forward all-reduce that a
    row-parallel linear implies (a column-parallel input's backward all-reduce is priced
    separately: once per distinct input)."""
    divisor = tp if strategy in ("C", "W", "S", "B") else kv_heads if strategy == "G" else 1
    seconds = (op_time(op, cluster.device, dtype, 1.0, 1.0, divisor)
               + op_backward_time(op, cluster.device, dtype, 1.0, 1.0, divisor))
    if strategy == "W":
        seconds += axis_collective_time("all_reduce", op.output_bytes, ParallelConfig(tp=tp),
                                        "tp", cluster)
    return seconds




def _decode_op_seconds(graph: Graph, op: OpNode, strategy: str, tp: int, cluster: Cluster,
                       dtype: str, kv_heads: int = 1) -> float:
    """One op's share of a decoding step of one sequence under one strategy: the bytes it
    reads (its weight, or for attention one sequence's cached keys and values) over the
    memory bandwidth, with the all-reduce of one token's output after a row-parallel linear.
    A decoding step is bound by these reads (see :mod:`autopar.cost.decode`), which split
    over tp where the tile and wave effects of a long captured sequence would not."""
    divisor = tp if strategy in ("C", "W", "S", "B") else kv_heads if strategy == "G" else 1
    device = cluster.device
    shape = graph.inputs[0].meta.shape if graph.inputs else ()
    batch = shape[0] if shape else 1
    tokens = batch * (shape[1] if len(shape) > 1 else 1)
    nbytes = op.output_bytes / tokens
    if op.kind is OpKind.ATTENTION:
        nbytes += sum(m.nbytes for m in op.input_meta[1:3]) / batch
    elif op.kind is not OpKind.EMBEDDING:
        nbytes += sum(graph.params[p].numel for p in op.params if p in graph.params) * \
            DTYPE_BYTES.get(dtype, 2)
    seconds = nbytes / divisor / (device.memory_bandwidth * device.efficiency.memory)
    if strategy == "W":
        seconds += axis_collective_time("all_reduce", op.output_bytes / tokens,
                                        ParallelConfig(tp=tp), "tp", cluster)
    return seconds


STRATEGY_NAMES = {"R": "replicate", "C": "column", "W": "row", "S": "split",
                  "G": "kv-replicated", "B": "broadcast"}


def node_options(graph: Graph, block: Block, tp: int, cluster: Cluster, dtype: str = "bf16"
                 ) -> dict[str, dict[str, float]]:
    """Per op of ``block``: seconds of every legal strategy at degree ``tp``.

    These are the terms of :func:`solve_block`'s objective, except that a column-parallel
    linear carries the whole backward all-reduce of its input, which the solver shares among
    all column-parallel readers of that input.
    """
    out: dict[str, dict[str, float]] = {}
    config = ParallelConfig(tp=tp)
    kv = kv_projections(graph, block, tp) if tp > 1 else {}
    for name in block.nodes:
        op = graph.op(name)
        costs = {}
        for s in (_strategies(graph, name, tp, kv) if tp > 1 else ["R"]):
            seconds = _op_seconds(op, s, tp, cluster, dtype, kv.get(name, 1))
            if s in ("C", "G", "B") and op.input_meta:
                seconds += axis_collective_time("all_reduce", op.input_meta[0].nbytes, config,
                                                "tp", cluster)
            costs[STRATEGY_NAMES[s]] = seconds
        out[name] = costs
    return out


def solve_block(graph: Graph, block: Block, tp: int, cluster: Cluster, dtype: str = "bf16",
                time_limit_s: float = 5.0, decode: bool = False, staged: bool = False
                ) -> ShardingSolution:
    """The cheapest legal sharding of ``block`` at degree ``tp`` (proved optimal by CP-SAT).
    With ``decode`` the objective is one serving decoding step instead of a training step
    (:func:`_decode_op_seconds`; no backward, so no input all-reduces)."""
    # the model's own activations (a frozen layer's too): the runtime slices none of them
    # for free; only inputs such as masks and rotary tables are sliced without cost
    grad = requires_grad(graph, frozen_count=False)
    members = set(block.nodes)
    config = ParallelConfig(tp=tp)
    model = cp_model.CpModel()
    x: dict[tuple[str, str], cp_model.IntVar] = {}
    cost_terms = []
    ns = 1e9

    def comm(kind: str, nbytes: float) -> int:
        return int(round(axis_collective_time(kind, nbytes, config, "tp", cluster) * ns))

    kv = kv_projections(graph, block, tp)
    whole = moe_region_linears(graph, block) if staged else set()
    for name in block.nodes:
        op = graph.op(name)
        options = ["R"] if name in whole else _strategies(graph, name, tp, kv, staged)
        for s in options:
            x[name, s] = model.NewBoolVar(f"{name}_{s}")
            seconds = (_decode_op_seconds(graph, op, s, tp, cluster, dtype, kv.get(name, 1))
                       if decode else _op_seconds(op, s, tp, cluster, dtype, kv.get(name, 1)))
            cost_terms.append(int(round(seconds * ns)) * x[name, s])
        model.AddExactlyOne(x[name, s] for s in options)
        if any(succ not in members for succ in graph.dag.successors(name)):
            for s in ("C", "S", "G", "B"):  # what the next block reads is replicated (outputs,
                # the logits, may stay split: the loss runs on vocabulary-parallel logits)
                if (name, s) in x:
                    model.Add(x[name, s] == 0)

    def out_split(name: str) -> list:
        return [x[name, s] for s in ("C", "S", "G", "B") if (name, s) in x]

    allreduce_inputs: dict[str, cp_model.IntVar] = {}
    for name in block.nodes:
        op = graph.op(name)
        for i, src in enumerate(op.inputs):
            inside = src in members
            src_split = sum(out_split(src)) if inside else 0
            takes_split = []
            for s in ("W", "S"):
                if (name, s) in x and (s == "S" or i == 0):
                    takes_split.append(x[name, s])
            if inside:
                # a split value flows only into ops that take split input
                for v in out_split(src):
                    model.Add(sum(takes_split) >= v) if takes_split else model.Add(v == 0)
            # a split consumer of a replicated value: free only when it carries no gradient
            if src in grad or (inside and src in grad):
                for t in takes_split:
                    if inside:
                        model.Add(src_split >= t)
                    else:
                        model.Add(t == 0)
            for s in ("C", "G", "B"):  # one backward all-reduce per distinct column input
                if decode or (name, s) not in x or i != 0:
                    continue
                if src not in allreduce_inputs:
                    allreduce_inputs[src] = model.NewBoolVar(f"ar_{src}")
                    nbytes = op.input_meta[0].nbytes
                    cost_terms.append(comm("all_reduce", nbytes) * allreduce_inputs[src])
                model.AddImplication(x[name, s], allreduce_inputs[src])
    for adapter, base, strategy in _adapter_ties(graph, block):
        if (base, strategy) in x:
            model.Add(x[adapter, strategy] == x[base, strategy])
        else:
            model.Add(x[adapter, strategy] == 0)
    model.Minimize(sum(cost_terms))
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1  # deterministic
    solver.parameters.random_seed = 0
    solver.parameters.max_time_in_seconds = time_limit_s
    status = solver.Solve(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        raise RuntimeError(f"sharding model for block type {block.type_id} has no solution")
    pos = {n: i for i, n in enumerate(block.nodes)}
    pick = {n: s for (n, s), v in x.items() if solver.Value(v)}
    return ShardingSolution(
        type_id=block.type_id, tp=tp, status=solver.StatusName(status),
        objective_s=solver.ObjectiveValue() / ns, bound_s=solver.BestObjectiveBound() / ns,
        column=[pos[n] for n, s in pick.items() if s == "C"],
        row=[pos[n] for n, s in pick.items() if s == "W"],
        sharded=[pos[n] for n, s in pick.items() if s in ("C", "S", "G", "B")],
        kv=[(pos[n], kv[n]) for n, s in pick.items() if s == "G"],
    )


def _adapter_ties(graph: Graph, block: Block) -> list[tuple[str, str, str]]:
    """(LoRA op, its base linear op, the strategy they share): a LoRA B is column-parallel
    exactly when its base is, a LoRA A row-parallel exactly when its base is."""
    by_weight = {}
    for name in block.nodes:
        op = graph.op(name)
        if op.kind is OpKind.LINEAR and op.params and not is_added_param(op.params[0]):
            by_weight[op.params[0].rpartition(".")[0]] = name
    ties = []
    for name in block.nodes:
        op = graph.op(name)
        if op.kind is OpKind.LINEAR and op.params and is_added_param(op.params[0]):
            module, _, leaf = op.params[0].rpartition(".")
            if module in by_weight and leaf in ("lora_A", "lora_B"):
                ties.append((name, by_weight[module], "W" if leaf == "lora_A" else "C"))
    return ties


def solve_layouts(graph: Graph, tps: list[int], cluster: Cluster, dtype: str = "bf16",
                  decode: bool = False, staged: bool = False
                  ) -> tuple[dict[int, TPLayouts], list[ShardingSolution]]:
    """Solve every block type at every degree in ``tps`` (> 1): the layouts per degree, for
    ``ParallelConfig.tp_layouts``, and the solver's reports; ``decode`` solves for a
    serving decoding step (task="infer"); ``staged`` solves for traced pipeline stages
    (:func:`staged_restrictions`)."""
    solutions = []
    layouts: dict[int, TPLayouts] = {}
    first_of_type: dict[int, Block] = {}
    for block in graph.blocks:
        first_of_type.setdefault(block.type_id, block)
    for tp in sorted(set(tps)):
        if tp <= 1:
            continue
        by_type = []
        for block in first_of_type.values():
            sol = solve_block(graph, block, tp, cluster, dtype, decode=decode, staged=staged)
            by_type.append((block.type_id, BlockLayout(tuple(sol.column), tuple(sol.row),
                                                       tuple(sol.sharded), tuple(sol.kv))))
            solutions.append(sol)
        layouts[tp] = TPLayouts(tp, tuple(by_type))
    return layouts, solutions
