"""Activation memory from the graph: what autograd keeps alive between forward and backward.

For every op whose output needs a gradient, a per-op rule says which tensors it saves
(``linear`` its input, ``softmax`` its output, ``dropout`` a 1-byte mask, ...). Saved tensors
are deduplicated by storage: a view of a tensor is the tensor, so a norm output that feeds
three projections is counted once. This reproduces Korthikanti et al. (2022)'s per-layer count
``s*b*h*(34 + 5*a*s/h)`` for a GPT layer with unfused attention.

Tensor parallelism divides the tensors that live inside a Megatron TP region (between a
column-parallel and a row-parallel linear, see :mod:`autopar.cost.tp_layout`); sequence
parallelism divides the rest too. Recompute modes:

- ``none``: everything saved;
- ``selective``: the attention core (the ops from the score matmul to the value matmul, or the
  fused SDPA op) is recomputed, so what only it saves is dropped; its inputs q, k, v stay;
- ``op``: torchtitan's op-level policy (:mod:`autopar.cost.recompute_policy`): the block's
  inputs and the outputs of the ops the policy keeps (every other projection, the fused
  attention output and its log-sum-exp) are kept; the rest is re-run;
- ``full``: only the block's inputs are kept.

A model whose RMSNorms run as one fused kernel (``graph.norm_kernel == "fused_rmsnorm"``, e.g.
torchtitan's Triton ``TritonFusedRMSNorm``, torchtitan/models/norms.py) keeps, per norm, only
what that kernel saves: its input, in the input's dtype, and one fp32 reciprocal RMS per row
(``ctx.save_for_backward(x, weight, rstd)``); the eager chain's fp32 upcast and normalized
copies never exist. The norm's output is still kept by the ops that read it.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

from autopar.capture.op_costs import packet_name
from autopar.cost.autocast_dtypes import (
    COMPUTE_DTYPES,
    captured_dtype,
    is_float,
    lower_precision,
    runtime_dtypes,
)
from autopar.cost.compute import kernel_dtype
from autopar.cost.config import TPLayouts
from autopar.cost.fused_regions import fused_regions
from autopar.cost.recompute_policy import RECOMPUTE_MODES, op_policy_saved
from autopar.cost.tp_layout import TPLayout, attention_core, tp_layout
from autopar.ir.graph import Block, Graph, OpKind, OpNode, dtype_bytes

# ops that save nothing for backward (their gradient needs only the output grad / shapes)
_SAVE_NOTHING = {"add", "sub", "neg", "to", "_to_copy", "cat", "stack", "sum", "mean",
                 "contiguous", "clone", "expand", "alias", "copy", "pad", "constant_pad_nd",
                 "repeat", "arange", "zeros", "ones", "full", "new_ones", "new_zeros",
                 "empty_like", "cumsum"}
_SAVE_MASK_ONLY = {"masked_fill", "where", "masked_scatter"}
_BINARY = {"mul", "div", "true_divide", "pow", "maximum", "minimum"}
# ops that save their output rather than their input
_SAVE_OUTPUT = {"softmax", "_softmax", "log_softmax", "_log_softmax", "relu", "sigmoid", "tanh",
                "exp", "rsqrt", "sqrt", "_safe_softmax"}


# norm kernels a model may state (``graph.norm_kernel``; "" is the captured eager graph)
NORM_KERNELS = ("", "fused_rmsnorm")


@dataclass(frozen=True)
class SavedTensor:
    root: str  # producing op (views resolved to their base)
    index: int  # which output of that op
    nbytes: int
    saver: str  # op that saves it


# pure functions of a graph, memoised per graph (graphs are not changed once captured): the
# search asks for the same block's activations at every micro-batch size, which only scales them
_MEMO: weakref.WeakKeyDictionary[Graph, dict] = weakref.WeakKeyDictionary()


def storage_root(graph: Graph, name: str) -> str:
    """Follow views back to the op that owns the storage (the capture already marks a
    ``contiguous`` of a fused attention's transposed output as a view: it copies nothing)."""
    roots = _MEMO.setdefault(graph, {}).setdefault("roots", {})
    root = roots.get(name)
    if root is None:
        root = roots[name] = _follow_views(graph, name)
    return root


def _follow_views(graph: Graph, name: str) -> str:
    seen = 0
    while graph.has_op(name) and graph.op(name).kind is OpKind.VIEW and seen < 64:
        op = graph.op(name)
        if not op.inputs:
            break
        name = op.inputs[0]
        seen += 1
    return name


def _input_bytes(graph: Graph, op: OpNode, i: int) -> int:
    return op.input_meta[i].nbytes if i < len(op.input_meta) else 0


def requires_grad(graph: Graph, frozen_count: bool = True) -> set[str]:
    """Ops whose outputs depend on a trainable parameter (so autograd records them). With
    ``frozen_count=False`` every parameter counts as trainable: the values that carry
    activations of the model's own computation, whatever a fine-tuning method froze."""
    memo = _MEMO.setdefault(graph, {})
    key = ("requires grad", frozen_count)
    if key in memo:
        return memo[key]
    out: set[str] = set()
    for op in graph.ops:
        if any(graph.params.get(p) is not None and (graph.params[p].trainable or
                                                     not frozen_count) for p in op.params):
            out.add(op.name)
        elif any(src in out for src in op.inputs):
            out.add(op.name)
    memo[key] = out
    return out


def saved_tensors(graph: Graph, op: OpNode, grad_ops: set[str]) -> list[SavedTensor]:
    """What ``op`` saves for its backward (activations only; parameters are not counted,
    nor views of them: a grouped expert matmul reads its weights through a transpose)."""
    return [t for t in _saved_tensors(graph, op, grad_ops)
            if not parameter_view(graph, t.root)]


def parameter_view(graph: Graph, name: str) -> bool:
    """Whether ``name`` is a view of a parameter (an op with no activation input that reads
    a parameter, such as the transpose of stacked expert weights): its storage is the
    weight's, which the memory model counts with the parameters."""
    if not graph.has_op(name):
        return False
    op = graph.op(name)
    return op.kind is OpKind.VIEW and not op.inputs and bool(op.params)


def _saved_tensors(graph: Graph, op: OpNode, grad_ops: set[str]) -> list[SavedTensor]:
    if op.name not in grad_ops or op.kind is OpKind.VIEW:
        return []
    name = packet_name(op.target)
    act_inputs = [(i, src) for i, src in enumerate(op.inputs)]
    if name in _SAVE_NOTHING:
        return []
    if name in ("dropout", "native_dropout", "feature_dropout"):
        numel = op.output_meta[0].numel
        return [SavedTensor(op.name + ":mask", 0, numel, op.name)]  # a 1-byte mask
    if name in _SAVE_OUTPUT:
        return [SavedTensor(op.name, 0, op.output_meta[0].nbytes, op.name)]
    if op.kind is OpKind.ATTENTION and name in ("scaled_dot_product_attention",
                                                "_scaled_dot_product_flash_attention",
                                                "_scaled_dot_product_efficient_attention",
                                                "_scaled_dot_product_flash_attention_for_cpu"):
        out = [_saved(graph, op, i, src) for i, src in act_inputs[:3]]
        out.append(SavedTensor(op.name, 0, op.output_meta[0].nbytes, op.name))
        q = op.input_meta[0]
        lse = q.numel // max(q.shape[-1], 1) * 4  # fp32 log-sum-exp per query row
        out.append(SavedTensor(op.name + ":lse", 0, lse, op.name))
        return out
    if name == "index":
        # the backward scatters the gradient by the indices into zeros of the input's shape:
        # it keeps the indices and the input's sizes, not the input (pytorch/pytorch
        # tools/autograd/derivatives.yaml, index.Tensor: self.sym_sizes(), self.options())
        return [_saved(graph, op, i, src) for i, src in act_inputs
                if not _floating(graph, src)]
    if name in _SAVE_MASK_ONLY:  # the backward only routes gradients through the mask
        return [_saved(graph, op, i, src) for i, src in act_inputs
                if i < len(op.input_meta) and op.input_meta[i].dtype == "bool"]
    if name in _BINARY and len(op.input_meta) < 2:
        return []  # times a Python scalar: nothing to keep
    if name == "mul" and len(op.inputs) == 2:
        # d(a*b)/da needs b, d(a*b)/db needs a: autograd keeps a factor only when the other
        # one needs a gradient (rotary's q * cos keeps cos, not q; pytorch/pytorch
        # tools/autograd/derivatives.yaml, mul.Tensor)
        return [_saved(graph, op, i, src) for i, src in act_inputs
                if storage_root(graph, op.inputs[1 - i]) in grad_ops
                or op.inputs[1 - i] in grad_ops]
    # default (linear, matmul, norms, mul, gelu, silu, embedding indices, ...): tensor inputs
    return [_saved(graph, op, i, src) for i, src in act_inputs]


def _floating(graph: Graph, src: str) -> bool:
    """Whether the value ``src`` holds floating-point numbers (not indices or a mask)."""
    return is_float(captured_dtype(graph, src))


def _saved(graph: Graph, op: OpNode, i: int, src: str) -> SavedTensor:
    """A saved input: the whole storage it views (q, k and v sliced from one qkv output keep
    that output alive once)."""
    root = storage_root(graph, src)
    if graph.has_op(root):
        nbytes = graph.op(root).output_meta[0].nbytes
    else:
        # a graph input (token ids): its own size. An op's input_meta also lists parameters
        # (an embedding's weight comes first), so position i is not the activation's
        nbytes = next((inp.meta.nbytes for inp in graph.inputs if inp.name == root),
                      _input_bytes(graph, op, i))
    return SavedTensor(root, 0, nbytes, op.name)


def fused_norm_saved(graph: Graph, block: Block) -> tuple[set[str], list[SavedTensor]]:
    """(the ops of ``block``'s RMSNorms that run as one fused kernel, what those kernels save):
    per norm module, its activation input (whole storage, as captured) and an fp32 rstd per
    row. Empty unless the graph states ``norm_kernel = "fused_rmsnorm"``."""
    kernel = getattr(graph, "norm_kernel", "")
    if kernel not in NORM_KERNELS:
        raise ValueError(f"norm_kernel must be one of {NORM_KERNELS}, not {kernel!r}")
    if kernel != "fused_rmsnorm":
        return set(), []
    regions: dict[str, list[str]] = {}
    for name in block.nodes:
        op = graph.op(name)
        if op.kind is OpKind.NORM and op.module_path and op.module_type.endswith("RMSNorm"):
            regions.setdefault(op.module_path, []).append(name)
    grad_ops = requires_grad(graph)
    fused: set[str] = set()
    saved: list[SavedTensor] = []
    for ops in regions.values():
        inside = set(ops)
        fused |= inside
        if not inside & grad_ops:
            continue  # autograd records no backward for it
        first = graph.op(ops[0])
        outer = [(i, src) for i, src in enumerate(first.inputs) if src not in inside]
        for i, src in outer[:1]:  # the activation (the weight is a parameter, not an input)
            saved.append(_saved(graph, first, i, src))
            meta = first.input_meta[i]
            rows = meta.numel // max(meta.shape[-1], 1) if meta.shape else 1
            saved.append(SavedTensor(ops[0] + ":rstd", 0, rows * 4, ops[0]))
    return fused, saved


@dataclass
class ActivationBreakdown:
    """Per-micro-batch activation bytes of one block on one device."""

    stored_bytes: float  # kept from forward to backward
    recompute_peak_bytes: float  # extra live while the block's backward recomputes


def block_activation_bytes(
    graph: Graph,
    block: Block,
    tp: int = 1,
    sequence_parallel: bool = False,
    recompute: str = "none",
    scale: float = 1.0,
    layouts: TPLayouts | None = None,
    fp8: bool = False,
    fused_kernels: bool = False,
    autocast: str | None = None,
) -> ActivationBreakdown:
    """Activation bytes of ``block`` per micro-batch on one device.

    ``scale`` rescales every byte count, e.g. (micro-batch / captured batch) x (bytes of the
    training dtype / bytes of the captured dtype). ``layouts`` are the tensor-parallel layouts
    the search chose (None: the Megatron layout). With ``fp8`` (FP8 compute), an input that
    only FP8 linears save is kept in FP8, one byte per element: Transformer Engine's linears
    save their quantized input with its column-wise data only, for the weight-gradient GEMM
    (transformer_engine/pytorch/module/linear.py, ``inputmat.update_usage(rowwise_usage=False,
    columnwise_usage=True)``); an input another op also saves stays in bf16. With
    ``fused_kernels`` (an engine that runs each norm, rotary embedding and gated activation
    as one kernel, :mod:`autopar.cost.fused_regions`), a region keeps the inputs it reads
    from outside, never its intermediates: a fused RMSNorm its input (not the fp32 upcast
    and the normalized copy), a fused SwiGLU the first projection's output (not the
    activation's output). With ``autocast`` ("bf16" or "fp16"), the model trains with fp32
    parameters under autocast to that dtype (:mod:`autopar.cost.autocast_dtypes`): each kept
    tensor has its run-time dtype, and ``scale`` must not convert dtypes (micro-batch only).
    """
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute must be one of {RECOMPUTE_MODES}, not {recompute!r}")
    chosen = layouts.get(block.type_id) if layouts is not None else None
    key = ("activations", block.index, tp, sequence_parallel, recompute, chosen, fp8,
           fused_kernels, autocast)
    memo = _MEMO.setdefault(graph, {})
    if key not in memo:
        memo[key] = _block_activation_bytes(graph, block, tp, sequence_parallel, recompute,
                                            layouts, fp8, fused_kernels, autocast)
    stored, peak = memo[key]
    return ActivationBreakdown(stored * scale, peak * scale)


def _block_activation_bytes(graph: Graph, block: Block, tp: int, sequence_parallel: bool,
                            recompute: str, layouts: TPLayouts | None,
                            fp8: bool, fused_kernels: bool = False,
                            autocast: str | None = None) -> tuple[float, float]:
    """Unscaled (stored, recompute peak) bytes of :func:`block_activation_bytes`."""
    grad_ops = requires_grad(graph)
    at_run_time = _run_time_bytes(graph, autocast)
    members = set(block.nodes)
    layout: TPLayout = tp_layout(graph, block, layouts)
    core = attention_core(graph, block) if recompute == "selective" else set()

    def divisor(root: str) -> int:
        base = root.split(":")[0]
        if tp <= 1:
            return 1
        if sequence_parallel or base in layout.sharded:
            return tp
        return 1

    stored: dict[tuple[str, int], float] = {}
    everything: dict[tuple[str, int], float] = {}
    only_fp8: dict[tuple[str, int], bool] = {}  # saved by FP8 linears alone
    fused_norm_ops, fused_norm_tensors = fused_norm_saved(graph, block)
    for t in fused_norm_tensors:
        nbytes = at_run_time(t) / divisor(t.root)
        everything[(t.root, t.index)] = nbytes
        stored.setdefault((t.root, t.index), nbytes)
    region_of = {n: k for k, region in enumerate(fused_regions(graph, block))
                 for n in region} if fused_kernels else {}
    for name in block.nodes:
        if name in fused_norm_ops:
            continue  # saved as one kernel (fused_norm_saved)
        op = graph.op(name)
        fp8_gemm = fp8 and kernel_dtype(op, "fp8") == "fp8"
        saved = _kernel_saved(graph, op, saved_tensors(graph, op, grad_ops), region_of)
        for t in _autocast_copies(graph, op, saved, autocast):
            key = (t.root, t.index)
            nbytes = at_run_time(t) / divisor(t.root)
            everything[key] = nbytes
            only_fp8[key] = only_fp8.get(key, True) and fp8_gemm
            if recompute == "selective" and op.name in core and t.root.split(":")[0] in core:
                continue  # produced and saved inside the recomputed core
            stored.setdefault(key, nbytes)
    for key, quantized in only_fp8.items():
        if quantized:  # one byte per element, not bf16's two
            everything[key] /= 2
            if key in stored:
                stored[key] /= 2
    if recompute in ("full", "op"):
        inputs: dict[str, float] = {}
        for name in block.nodes:
            op = graph.op(name)
            for i, src in enumerate(op.inputs):
                if src not in members and src in grad_ops:
                    root = storage_root(graph, src)
                    inputs[root] = at_run_time(SavedTensor(root, 0, _input_bytes(graph, op, i),
                                                           name)) / divisor(root)
        kept = op_policy_outputs(graph, block, divisor) if recompute == "op" else {}
        kept = {r: at_run_time(SavedTensor(r, 0, b, r)) for r, b in kept.items()}
        total_stored = sum(inputs.values()) + sum(kept.values())
        # the backward re-runs the block and holds what autograd saves, except what is kept
        peak = sum(v for (root, _), v in everything.items() if root not in kept)
    else:
        total_stored = sum(stored.values())
        peak = sum(everything.values()) - total_stored
    return total_stored, peak


def _run_time_bytes(graph: Graph, autocast: str | None):
    """The bytes of a :class:`SavedTensor` at run time: as captured, or under autocast its
    value's run-time dtype (a derived tensor such as ``:lse`` or ``:cast`` is sized already)."""
    if autocast is None:
        return lambda t: t.nbytes
    dtypes = runtime_dtypes(graph, autocast)

    def nbytes(t: SavedTensor) -> float:
        if ":" in t.root:
            return t.nbytes
        captured = captured_dtype(graph, t.root)
        now = dtypes.get(t.root, captured)
        if captured == now or not is_float(captured):
            return t.nbytes
        return t.nbytes * dtype_bytes(now) / dtype_bytes(captured)
    return nbytes


def _autocast_copies(graph: Graph, op: OpNode, saved: list[SavedTensor],
                     autocast: str | None) -> list[SavedTensor]:
    """``saved`` under autocast: an op autocast runs in the compute dtype keeps its own cast
    copy of each fp32 activation it reads, not the fp32 value (keyed by the value and the op:
    three projections of one fp32 norm output keep three copies)."""
    if autocast is None or not lower_precision(op):
        return saved
    dtypes = runtime_dtypes(graph, autocast)
    out = []
    for t in saved:
        if ":" in t.root or dtypes.get(t.root) != "float32":
            out.append(t)
            continue
        captured = captured_dtype(graph, t.root) or "float32"
        copy = t.nbytes * dtype_bytes(COMPUTE_DTYPES[autocast]) / dtype_bytes(captured)
        out.append(SavedTensor(f"{t.root}:cast@{op.name}", 0, copy, op.name))
    return out


def _kernel_saved(graph: Graph, op: OpNode, saved: list[SavedTensor],
                  region_of: dict[str, int]) -> list[SavedTensor]:
    """``saved`` as a fused kernel keeps it: a tensor made inside ``op``'s own region is not
    kept; the region's outside inputs it was computed from are, in its place."""
    region = region_of.get(op.name)
    if region is None:
        return saved
    out: list[SavedTensor] = []
    for t in saved:
        base = t.root.split(":")[0]
        if region_of.get(base) != region:
            out.append(t)
            continue
        seen, frontier = set(), [base]
        while frontier:
            name = frontier.pop()
            if name in seen:
                continue
            seen.add(name)
            if region_of.get(name) == region:
                frontier.extend(graph.op(name).inputs)
            elif _floating(graph, name):
                out.append(_saved(graph, op, 0, name))
    return out


def op_policy_outputs(graph: Graph, block: Block, divisor) -> dict[str, float]:
    """Bytes of each output that mode ``op`` keeps in ``block`` (the checkpoint's cache of the
    kept ops; a fused attention kernel keeps its output and its fp32 log-sum-exp), keyed like
    :class:`SavedTensor` roots; ``divisor(root)`` is the tensor-parallel split of a root."""
    kept: dict[str, float] = {}
    for name in op_policy_saved(graph, block):
        op = graph.op(name)
        if not op.output_meta:
            continue
        kept[name] = op.output_meta[0].nbytes / divisor(name)
        if op.kind is OpKind.ATTENTION and op.input_meta:
            q = op.input_meta[0]
            lse = q.numel // max(q.shape[-1], 1) * 4  # fp32 per query row, as saved_tensors
            kept[name + ":lse"] = lse / divisor(name)
    return kept


def forward_peak_bytes(graph: Graph, block: Block, tp: int = 1, scale: float = 1.0,
                       layouts: TPLayouts | None = None, output_positions: int = 1) -> float:
    """The most bytes live at once while ``block`` runs forward without autograd (a serving
    prefill): each value lives from the op that writes it to the last op of the block that
    reads it (views share their base's storage); the block's inputs live until their last
    reader; the block's outputs stay. Values inside a tensor-parallel region are split. The
    model's outputs (logits) are divided by ``output_positions``: a prefill computes them
    for the last position only, not for each of the captured ones."""
    chosen = layouts.get(block.type_id) if layouts is not None else None
    key = ("forward peak", block.index, tp, chosen, output_positions)
    memo = _MEMO.setdefault(graph, {})
    if key not in memo:
        memo[key] = _forward_peak_bytes(graph, block, tp, layouts, output_positions)
    return memo[key] * scale


def _forward_peak_bytes(graph: Graph, block: Block, tp: int, layouts: TPLayouts | None,
                        output_positions: int) -> float:
    layout = tp_layout(graph, block, layouts)
    members = set(block.nodes)
    order = {name: k for k, name in enumerate(block.nodes)}
    last_use: dict[str, int] = {}
    size: dict[str, float] = {}
    inputs = {i.name: i.meta.nbytes for i in graph.inputs}
    for name in block.nodes:
        op = graph.op(name)
        for src in op.inputs:
            root = storage_root(graph, src)
            last_use[root] = max(last_use.get(root, -1), order[name])
            if root not in members and root not in size:
                size[root] = float(graph.op(root).output_bytes if graph.has_op(root) else
                                   inputs.get(root, 0))
        if op.kind is not OpKind.VIEW:
            size[name] = float(op.output_bytes) / (tp if tp > 1 and name in layout.sharded
                                                   else 1)
            if name in graph.outputs:
                size[name] /= output_positions
    end = len(block.nodes)
    for name in block.nodes:  # what leaves the block outlives it
        if any(user not in members for user in graph.dag.successors(name)):
            last_use[storage_root(graph, name)] = end
    live = sum(size[r] for r in size if r not in members)
    peak = live
    for k, name in enumerate(block.nodes):
        if name in size and graph.op(name).kind is not OpKind.VIEW:
            live += size[name]
            peak = max(peak, live)
        for root in {storage_root(graph, s) for s in graph.op(name).inputs}:
            if last_use.get(root) == k and root in size:
                live -= size[root]
        if last_use.get(name, -1) < k and name in size and \
                graph.op(name).kind is not OpKind.VIEW:
            live -= size[name]  # written and never read inside the block
    return peak
