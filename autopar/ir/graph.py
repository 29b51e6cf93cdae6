"""autopar's intermediate representation: a DAG of ops with shapes, costs and parameters.

Every later pass (cost, search, codegen) reads this and nothing upstream of it, so it carries
everything they need: per-op FLOPs and bytes, the parameters each op touches, the module path
it came from, and the grouping of ops into blocks (repeated layers and the parts around them).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from functools import cached_property

import networkx as nx


class OpKind(str, enum.Enum):
    """Normalised op kinds; the search decides shardings per kind."""

    LINEAR = "linear"  # a matmul with a parameter operand (nn.Linear, Conv1D, ONNX Gemm)
    MATMUL = "matmul"  # a matmul of two activations
    ATTENTION = "attention"  # scaled-dot-product attention (fused or the two matmuls inside it)
    EMBEDDING = "embedding"
    NORM = "norm"
    ELEMENTWISE = "elementwise"
    REDUCTION = "reduction"
    VIEW = "view"  # reshape/transpose/slice/...: no FLOPs, no data movement
    MOE_ROUTER = "moe_router"
    MOE_EXPERT = "moe_expert"
    OTHER = "other"


@dataclass(frozen=True)
class TensorMeta:
    """Shape and dtype of one tensor value (dtype spelled as in torch, e.g. ``float32``)."""

    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * dtype_bytes(self.dtype)


_DTYPE_BYTES = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1,
    "float8_e5m2": 1, "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
    "complex64": 8, "complex128": 16,
}


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a dtype name; unknown names count as 4 (fp32-sized)."""
    return _DTYPE_BYTES.get(dtype, 4)


@dataclass
class ParamInfo:
    """One parameter (or buffer) of the model, by fully qualified name."""

    fqn: str
    shape: tuple[int, ...]
    dtype: str
    trainable: bool = True
    aliases: tuple[str, ...] = ()  # other FQNs of the same tensor (tied weights)

    @property
    def numel(self) -> int:
        return TensorMeta(self.shape, self.dtype).numel

    @property
    def nbytes(self) -> int:
        return TensorMeta(self.shape, self.dtype).nbytes


@dataclass
class OpNode:
    """One op of the captured graph."""

    name: str
    target: str  # e.g. "aten.linear.default" or ONNX "MatMul"
    kind: OpKind
    inputs: list[str]  # names of producer nodes (graph inputs and ops), in argument order
    input_meta: list[TensorMeta]
    output_meta: list[TensorMeta]
    flops: int  # forward FLOPs (multiply-add = 2)
    bytes_read: int
    bytes_written: int
    params: list[str] = field(default_factory=list)  # FQNs of parameters this op reads
    module_path: str = ""  # e.g. "model.layers.3.self_attn.q_proj"
    module_type: str = ""  # class name of the innermost module
    block: int = -1  # index into Graph.blocks
    # an einsum projection (a LINEAR op not stored as nn.Linear's (out, in)): the dimension of
    # its weight that indexes output features (autopar.capture.einsum_projection)
    weight_out_dim: int | None = None

    @property
    def output_bytes(self) -> int:
        return sum(m.nbytes for m in self.output_meta)


@dataclass
class Block:
    """A contiguous group of ops: one repeated layer, or the non-repeated head/tail of a model.

    Blocks with the same ``type_id`` have identical structure (ops, shapes, parameter shapes) and
    are interchangeable for the solver.
    """

    index: int
    name: str  # module path of the layer ("model.layers.3") or "head"/"tail"
    role: str  # "head" | "layer" | "tail"
    kind: str  # "embedding" | "transformer" | "moe" | "output" | "other"
    type_id: int
    nodes: list[str]
    params: list[str]
    flops: int
    param_numel: int
    param_bytes: int
    output_bytes: int  # bytes of the activations that leave the block (pipeline send size)


@dataclass
class GraphInput:
    name: str
    meta: TensorMeta


class Graph:
    """The captured model: ``dag`` is a networkx DiGraph whose nodes are op names with the
    :class:`OpNode` under attribute ``op``; edges run producer -> consumer."""

    def __init__(
        self,
        ops: list[OpNode],
        inputs: list[GraphInput],
        params: dict[str, ParamInfo],
        buffers: dict[str, ParamInfo],
        outputs: list[str],
        source: str,
        model_config: dict | None = None,
    ) -> None:
        self.ops: list[OpNode] = ops  # topological (execution) order
        self.inputs = inputs
        self.params = params
        self.buffers = buffers
        self.outputs = outputs
        self.source = source  # "torch.export" | "fx.symbolic_trace" | "onnx"
        self.model_config = model_config or {}
        # the fine-tuning method applied before capture (autopar.peft.PeftConfig.to_dict())
        self.peft: dict = {}
        # why autopar's runtime cannot run context parallelism on the captured model (None: it
        # can); capture sets it from the module (autopar.capture.attention_hook)
        self.context_parallel_refusal: str | None = None
        self.blocks: list[Block] = []
        self.dag = nx.DiGraph()
        for inp in inputs:
            self.dag.add_node(inp.name, op=None, input=inp)
        for op in ops:
            self.dag.add_node(op.name, op=op)
            for src in op.inputs:
                if src in self.dag:
                    self.dag.add_edge(src, op.name)

    # -- lookup ---------------------------------------------------------------------------
    @cached_property
    def _by_name(self) -> dict[str, OpNode]:
        return {op.name: op for op in self.ops}

    def op(self, name: str) -> OpNode:
        return self._by_name[name]

    def has_op(self, name: str) -> bool:
        """Whether ``name`` is an op of this graph (inputs and parameters are not)."""
        return name in self._by_name

    def ops_of_kind(self, *kinds: OpKind) -> list[OpNode]:
        return [op for op in self.ops if op.kind in kinds]

    # -- totals ---------------------------------------------------------------------------
    @cached_property
    def num_params(self) -> int:
        """Distinct parameter elements (tied weights counted once)."""
        return sum(p.numel for p in self.params.values())

    @cached_property
    def param_bytes(self) -> int:
        return sum(p.nbytes for p in self.params.values())

    @property
    def buffer_bytes(self) -> int:
        return sum(b.nbytes for b in self.buffers.values())

    @cached_property
    def flops(self) -> int:
        """Forward FLOPs of one call with the captured inputs."""
        return sum(op.flops for op in self.ops)

    @property
    def bytes_moved(self) -> int:
        return sum(op.bytes_read + op.bytes_written for op in self.ops)

    @cached_property
    def tokens(self) -> int:
        """Batch x sequence of the first integer input (token ids), else the batch size."""
        for inp in self.inputs:
            if inp.meta.dtype.startswith("int") and len(inp.meta.shape) >= 2:
                return inp.meta.shape[0] * inp.meta.shape[1]
        return self.inputs[0].meta.shape[0] if self.inputs and self.inputs[0].meta.shape else 1

    @property
    def flops_per_token(self) -> float:
        return self.flops / max(self.tokens, 1)

    def flops_by_kind(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for op in self.ops:
            out[op.kind.value] = out.get(op.kind.value, 0) + op.flops
        return out

    def block_types(self) -> dict[int, list[Block]]:
        """Blocks grouped by structural type, in order of first appearance (do not modify)."""
        cached = self.__dict__.get("_block_types")
        if cached is None or cached[0] is not self.blocks or cached[1] != len(self.blocks):
            out: dict[int, list[Block]] = {}
            for b in self.blocks:
                out.setdefault(b.type_id, []).append(b)
            cached = (self.blocks, len(self.blocks), out)
            self.__dict__["_block_types"] = cached
        return cached[2]

    @property
    def layer_blocks(self) -> list[Block]:
        return [b for b in self.blocks if b.role == "layer"]

    def __repr__(self) -> str:
        return (
            f"Graph({len(self.ops)} ops, {self.num_params:,} params, "
            f"{len(self.blocks)} blocks, source={self.source})"
        )
