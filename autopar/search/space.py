"""The search space: legal meshes and knobs, read off the graph (never the model's name)."""

from __future__ import annotations

from dataclasses import dataclass

from autopar.cost.activations import storage_root
from autopar.cost.context_parallel import all_to_all_ranks, ulysses_refusal
from autopar.cost.engines import engine_features
from autopar.cost.tp_layout import megatron_layout
from autopar.ir.graph import Graph, OpKind
from autopar.peft import is_added_param
from autopar.plan.support import proposed_cp, runtime_cp_modes

SCHEDULES_PP = ("1f1b", "interleaved", "zero_bubble", "gpipe")
OFFLOAD_CHOICES: tuple[tuple[str, ...], ...] = (
    (), ("optimizer",), ("activations", "optimizer"), ("optimizer", "params"),
    ("activations", "optimizer", "params"))


def offload_choices(device_type: str, train: bool) -> tuple[tuple[str, ...], ...]:
    """The offload sets the search tries: none on a CPU device (its host memory is its own,
    so offloading frees nothing); parameters only for inference."""
    if device_type == "cpu":
        return ((),)
    return OFFLOAD_CHOICES if train else ((), ("params",))


@dataclass(frozen=True)
class ModelFacts:
    """What legality depends on, from the graph."""

    blocks: int
    layers: int
    heads: tuple[int, ...]  # every attention's query heads and key/value heads
    split_dims: tuple[int, ...]  # feature sizes a tensor-parallel split must divide
    experts: int  # 0 for a dense model
    expert_params: int  # parameter elements inside experts (split by ep, not tp)
    batch: int  # captured batch
    seq: int
    trainable_params: int = 0  # parameter elements that train (all but a frozen base's)
    trainable_expert_params: int = 0
    # whether the layers carry a sequence (an attention reads one): sequence parallelism
    # shards the (batch, sequence, hidden) stream, which a ConvNet or an MLP does not have
    sequence_stream: bool = True
    # why autopar's runtime cannot run cp > 1 on this model (None: it can; other engines
    # export cp whatever the model): Graph.context_parallel_refusal, R-Drop's two passes
    cp_refusal: str | None = None

    def tp_ok(self, tp: int) -> bool:
        """Whether the layers' projections split evenly over ``tp``. Heads need not divide:
        the sharding solver keeps an attention whose heads do not divide replicated."""
        return all(d % tp == 0 for d in self.split_dims)

    def ep_ok(self, ep: int) -> bool:
        return ep == 1 or (self.experts > 0 and self.experts % ep == 0)

    def ulysses_refusal(self, tp: int, degree: int, engine: str | None = None) -> str | None:
        """Why an all-to-all (Ulysses) over ``degree`` context-parallel ranks cannot split
        the attention heads of a tp rank under ``engine`` (None: one that does not repeat
        key/value heads), or None when it can."""
        if len(self.heads) < 1:
            return None
        query, kv = max(self.heads), min(self.heads)
        replicate = engine is not None and engine_features(engine).ulysses_replicates_kv
        return ulysses_refusal(query, kv, tp, degree, replicate)


def model_facts(graph: Graph) -> ModelFacts:
    heads: set[int] = set()
    dims: set[int] = set()
    experts = 0
    for op in graph.ops:
        if op.kind is OpKind.ATTENTION and len(op.input_meta) >= 3 and \
                len(op.input_meta[0].shape) == 4:
            heads.add(op.input_meta[0].shape[1])
            for i in (1, 2):  # key/value heads before any grouped-query repetition
                root = storage_root(graph, op.inputs[i])
                meta = graph.op(root).output_meta[0] if graph.has_op(root) else op.input_meta[i]
                if len(meta.shape) == 4 and meta.shape[-1] == op.input_meta[i].shape[-1]:
                    heads.add(meta.shape[1])  # a (batch, heads, seq, dim) tensor
                else:  # a packed projection's storage (nn.MultiheadAttention)
                    heads.add(op.input_meta[i].shape[1])
        if op.kind is OpKind.MOE_EXPERT:
            for p in op.params:
                shape = graph.params[p].shape if p in graph.params else ()
                if len(shape) == 3:
                    experts = max(experts, shape[0])
    # the repeated layers must split evenly; an embedding or output head whose vocabulary
    # does not divide stays replicated instead (the sharding solver only splits what divides)
    for block in graph.layer_blocks or graph.blocks:
        layout = megatron_layout(graph, block)
        for name in layout.column:
            # a projection to one feature (Qwen2-MoE's shared-expert gate) can never split;
            # the sharding solver keeps it replicated, and it constrains no tp. A LoRA factor
            # splits only along its base linear's features
            if (width := graph.op(name).output_meta[0].shape[-1]) > 1 and \
                    not _adapter(graph, name):
                dims.add(width)
        for name in layout.row:
            if not _adapter(graph, name):
                dims.add(graph.op(name).input_meta[0].shape[-1])
    if experts == 0:  # experts as a ModuleList: count distinct indices under "experts"
        idx = {p.split(".experts.")[1].split(".")[0] for p in graph.params if ".experts." in p}
        experts = len([i for i in idx if i.isdigit()])
    expert_numel = sum(graph.params[p].numel for p in {p for op in graph.ops
                                                         if op.kind is OpKind.MOE_EXPERT
                                                         for p in op.params}
                       if p in graph.params)
    first = graph.inputs[0].meta.shape if graph.inputs else (1, 1)
    expert_names = {p for op in graph.ops if op.kind is OpKind.MOE_EXPERT for p in op.params}
    trainable = [p for p in graph.params.values() if p.trainable]
    return ModelFacts(
        blocks=len(graph.blocks), layers=len(graph.layer_blocks) or len(graph.blocks),
        heads=tuple(sorted(heads)), split_dims=tuple(sorted(dims)), experts=experts,
        expert_params=expert_numel,
        batch=first[0] if first else 1, seq=first[1] if len(first) > 1 else 1,
        trainable_params=sum(p.numel for p in trainable),
        trainable_expert_params=sum(p.numel for p in trainable if p.fqn in expert_names),
        sequence_stream=any(op.kind is OpKind.ATTENTION for op in graph.ops),
        cp_refusal=getattr(graph, "context_parallel_refusal", None) or (
            "R-Drop's two passes do not run with context parallelism's token-summed loss"
            if graph.peft.get("method") == "rdrop" else None),
    )


def _adapter(graph: Graph, name: str) -> bool:
    return any(is_added_param(p) for p in graph.op(name).params)


def tp_tiles_nodes(tp: int, devices_per_node: int) -> bool:
    """Tensor-parallel groups either fit whole in a node (tp divides the node size) or are
    made of whole nodes: tp = 3 on 8-GPU nodes would split a group across two nodes."""
    if tp <= devices_per_node:
        return devices_per_node % tp == 0
    return tp % devices_per_node == 0


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class Mesh:
    pp: int
    dp: int
    tp: int
    ep: int
    cp: int = 1
    cp_mode: str = "ring"  # how the cp ranks exchange keys and values (not an axis)

    def as_dict(self) -> dict[str, int]:
        return {"pp": self.pp, "dp": self.dp, "cp": self.cp, "ep": self.ep, "tp": self.tp}


MESH_AXES = ("pp", "dp", "cp", "ep", "tp")


def cp_degrees(facts: ModelFacts, devices: int, pins: dict, engine: str | None) -> list[int]:
    """The context-parallel degrees the search tries: the pinned one; with ``engine`` None
    (serving) or an engine that runs no context parallelism, 1; else every divisor of the
    devices whose ranks can share each sequence evenly (cp > 1 only for models with
    attention, whose sequence it splits)."""
    pinned = proposed_cp(pins, engine or "autopar") if engine else int(pins.get("cp", 1))
    if pinned is not None:
        return [pinned]
    if not facts.sequence_stream or not facts.heads:
        return [1]
    if engine == "autopar" and facts.cp_refusal is not None:  # the runtime cannot swap it in
        return [1]
    return [c for c in divisors(devices) if c == 1 or facts.seq % c == 0]


def cp_modes(facts: ModelFacts, cp: int, tp: int, ep: int, devices_per_node: int, pins: dict,
             engine: str | None) -> list[str]:
    """The cp modes worth pricing for one mesh: the pinned one, else each mode ``engine``
    runs (the ring where it runs none: a pinned cp) that can split this sequence and these
    heads. Ring, hybrid and all-gather cut the sequence in 2 cp chunks (causal load
    balancing: rank i holds chunks i and 2cp-1-i); all-to-all needs whole heads per rank; a hybrid whose all-to-all spans 1 or all cp ranks
    is the ring or the all-to-all, priced once under that name."""
    if "cp_mode" in pins or cp == 1 or engine is None:
        return [pins.get("cp_mode", "ring")]
    out = []
    # a pinned cp on an engine that runs none is priced as a ring (reported, not run)
    for mode in runtime_cp_modes(engine) or ("ring",):
        a2a = all_to_all_ranks(cp, mode, tp, ep, devices_per_node)
        if mode == "hybrid" and a2a in (1, cp):
            continue
        if facts.seq % (cp if mode == "alltoall" else 2 * cp):
            continue
        if facts.ulysses_refusal(tp, a2a, engine) is not None:
            continue
        out.append(mode)
    return out


def legal_meshes(facts: ModelFacts, devices: int, global_batch: int, devices_per_node: int,
                 pins: dict, allow_cross_node_tp: bool = False,
                 engine: str | None = None) -> list[Mesh]:
    """Every pp x dp x cp x ep x tp = devices (with its cp mode) that the model and batch
    allow (and pins keep). Context parallelism is the pinned degree and mode, else (given
    the ``engine`` that runs the plan, and only where it runs cp:
    :func:`autopar.plan.support.runtime_runs_cp`) every degree and mode the model allows;
    without an engine (serving) the pinned degree or 1."""
    out = []
    for cp in cp_degrees(facts, devices, pins, engine):
        if devices % cp:
            continue
        for tp in divisors(devices // cp):
            if not facts.tp_ok(tp) or (tp > devices_per_node and not allow_cross_node_tp):
                continue
            if not tp_tiles_nodes(tp, devices_per_node):
                continue
            for pp in divisors(devices // (tp * cp)):
                if pp > facts.blocks:
                    continue
                for ep in divisors(devices // (tp * pp * cp)):
                    if not facts.ep_ok(ep):
                        continue
                    dp = devices // (tp * pp * ep * cp)
                    if global_batch % (dp * ep):
                        continue
                    for mode in cp_modes(facts, cp, tp, ep, devices_per_node, pins, engine):
                        a2a = all_to_all_ranks(cp, mode, tp, ep, devices_per_node)
                        if facts.ulysses_refusal(tp, a2a, engine) is not None:
                            continue  # Ulysses' all-to-all needs whole heads per rank
                        mesh = Mesh(pp, dp, tp, ep, cp, mode)
                        if all(getattr(mesh, k) == v for k, v in pins.items()
                               if k in MESH_AXES):
                            out.append(mesh)
    return out
