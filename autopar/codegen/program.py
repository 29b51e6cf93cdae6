"""The training program ``autopar compile`` writes beside plan.yaml (``train.py``): the plan's
mesh, tensor-parallel styles, recompute, data-parallel sharding, pipeline split and optimizer
as plain PyTorch statements. ``autopar run DIR`` and ``torchrun DIR/train.py`` execute it;
tests load the same text, so what is generated is what runs.

The program defines the functions the runtime's Trainer calls, in this order:
``build_mesh(device)``; then, before any weight exists (on meta), ``parallelize(model, mesh,
plan)`` or, for pipelines, ``parallelize_stage(stage, mesh, plan, original)`` on each of this
rank's stages (split at ``PIPELINE["chunks"]``); after the weights are allocated,
``replicate(model, mesh, plan)``; and ``build_optimizer(param_groups, mesh, hp)``.

``autopar.parallelize`` runs the same program, rendered in memory for the user's model
(:func:`model_program`) with one stated option, the LM head's output gathered whole, and
calls the same functions on the model's real weights.
"""

from __future__ import annotations

import json
import re
import types
from collections import Counter

from torch import nn

from autopar.artifact.load import load_program
from autopar.codegen.cp_program import (
    CP_AXES,
    DP_CP,
    context_parallel_mesh,
    context_parallel_statements,
    dp_axis,
)
from autopar.cost.precision import TORCH_DTYPE_NAMES
from autopar.models.source import build_from_source
from autopar.parallel.expert_parallel import experts_use_ddp
from autopar.parallel.style_spec import StyleSpec
from autopar.parallel.tensor_parallel import (
    TensorParallelLayout,
    chunk_boundary_styles,
    layer_names,
    tensor_parallel_layout,
)
from autopar.peft import apply_peft
from autopar.plan import Plan
from autopar.plan.launch import on_each_node, plan_launch
from autopar.plan.parallelisms import registered


def program_text(plan: Plan, source: dict, *, model_name: str = "",
                 whole_logits: bool = False) -> str:
    """The program for ``plan`` (``source``: the manifest's model recipe). ``whole_logits``:
    see :func:`model_program_text`."""
    model = build_from_source(source, seed=0, device="meta")
    if plan.peft:  # the layout names the adapters' parameters too

        apply_peft(model, plan.peft)
    return model_program_text(plan, model, source=source, model_name=model_name,
                              whole_logits=whole_logits)


def model_program_text(plan: Plan, model: nn.Module, *, source: dict | None = None,
                       model_name: str = "", whole_logits: bool = False) -> str:
    """The program for ``plan`` and ``model`` (read for its structure only, never changed: on
    meta, or the user's model with its weights; with the plan's fine-tuning method applied).
    ``whole_logits``: a tensor-parallel LM head gathers its output whole on every rank, for a
    caller's own loss (``autopar.parallelize``), instead of leaving it split over the
    vocabulary for autopar's vocabulary-parallel loss (the Trainer's); the program states
    which.

    The program states what the plan decided as PyTorch calls, top to bottom: the mesh of
    the axes in use, one tensor-parallel layer plan applied in a loop over the layers (and
    the styles of the modules around them), the recompute rule by block type, the
    data-parallel wrapper, the optimizer. What the plan lists block by block (the layers,
    the pipeline chunks and their boundaries' relayouts, a traced stage's split leaves,
    which layer recomputes how) is read from the plan by ``autopar.parallel.program_steps``,
    so the program is as long for 80 layers as for 8."""
    source = source or {}
    m = plan.mesh
    layout = None
    if m["tp"] > 1:
        layout = tensor_parallel_layout(model, plan, traced=m["pp"] > 1,
                                        whole_logits=whole_logits)
    layers = [n for n in layer_names(plan)]
    w = _Writer()
    _header(w, plan, source, model_name or type(model).__name__,
            layout.styles if layout is not None else None)
    _mesh(w, plan)
    if plan.peft:
        _peft(w, plan)
    if layout is not None:
        _layer_plan(w, plan, layout, layers)
        _logits_statement(w, layout, layers, whole_logits)
    _recompute_rule(w, plan)
    if m["pp"] > 1:
        _pipeline(w, plan, layout)
    else:
        _parallelize(w, plan, layout)
    _replicate(w, plan)
    _optimizer(w, plan)
    w.blank(2)
    w.line('if __name__ == "__main__":  # launched as the Run: line says; autopar run\'s options '
           'apply')
    w.line("    with one_line_errors():  # a bad option or input: one line, exit code 2")
    w.line("        train_artifact(RunOptions.from_argv(__file__))")
    return w.text()


# the file name a program rendered in memory is compiled under (tracebacks name it)
IN_MEMORY_PROGRAM = "<autopar.parallelize train.py>"


def model_program(plan: Plan, model: nn.Module, *, whole_logits: bool = True
                  ) -> tuple[str, types.ModuleType]:
    """(text, module) of the training program for ``plan`` and ``model``, rendered in memory
    (no artifact directory) and loaded as a fresh module: what ``autopar.parallelize`` runs.
    The text is this module's own output; plan values enter it only as literals."""
    text = model_program_text(plan, model, whole_logits=whole_logits)
    return text, load_program(text, IN_MEMORY_PROGRAM)


def generated_program(plan: Plan, source: dict) -> types.ModuleType:
    """The program for ``plan``, generated and loaded (what a fresh artifact's train.py is)."""
    return load_program(program_text(plan, source))


class _Writer:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def line(self, text: str = "") -> None:
        self.lines.append(text)

    def blank(self, n: int = 1) -> None:
        self.lines.extend([""] * n)

    def text(self) -> str:
        return "\n".join(self.lines).rstrip() + "\n"


def _list(items: list[str]) -> str:
    return "[" + ", ".join(json.dumps(i) for i in items) + "]"


def _dict(d: dict) -> str:
    if not d:
        return "{}"
    inner = ",\n".join(f"    {json.dumps(k)}: {_value(v)}" for k, v in d.items())
    return "{\n" + inner + ",\n}"


_PROSE_UNSAFE = re.compile(r"[^\w.+\-@:/ ,()\[\]=<>%']")


def _chunk_summary(plan: Plan) -> str:
    """How the runtime cuts the blocks into pipeline chunks, in a few words (ints only):
    the chunks themselves when they are few, else their count and sizes."""
    chunks = [(int(a), int(b)) for a, b in plan.chunk_ranges()]
    if len(chunks) <= 4:
        cut = ", ".join(f"{a}-{b - 1}" for a, b in chunks)
        return f"chunks of blocks {cut} (chunk c on pp rank c % pp)"
    sizes = sorted({b - a for a, b in chunks})
    size = f"{sizes[0]}" if len(sizes) == 1 else f"{sizes[0]}-{sizes[-1]}"
    return f"{len(chunks)} chunks of {size} blocks, chunk c on pp rank c % pp"


def prose(value: object) -> str:
    """``value`` as text that is safe inside the program's docstring or a comment: anything
    but letters, digits, spaces and plain punctuation (quotes, backslashes, line breaks)
    becomes "?", so no value (a cluster or model name from a file) can end either and run."""
    return _PROSE_UNSAFE.sub("?", str(value))


def _value(v: object) -> str:
    if isinstance(v, StyleSpec):
        return str.__str__(v)  # a style record's source: its arguments rendered by repr
    if isinstance(v, tuple):
        return "(" + ", ".join(_value(x) for x in v) + ")"
    return json.dumps(v)


def _header(w: _Writer, plan: Plan, source: dict, model_name: str,
            styles: dict[str, str] | None) -> None:
    m = plan.mesh
    predicted = plan.predicted.step_time_s if plan.predicted else 0.0
    w.line('"""Training program for ' + prose(model_name) + f" on {plan.devices} device"
           + ("s" if plan.devices > 1 else "") + ", generated by autopar from plan.yaml.")
    w.blank()
    if m.get("cp", 1) > 1:
        w.line(f"context parallelism: cp={m['cp']}, {plan.cp_mode} attention; each sequence cut "
               f"into {2 * m['cp']} chunks, rank i of cp holding chunks i and {2 * m['cp'] - 1}-i")
    axes = mesh_axes(plan)
    w.line((f"mesh ({', '.join(axes)}) = ({', '.join(str(m[a]) for a in axes)})"
            + (", tp innermost" if len(axes) > 1 else "") if axes else "one device")
           + f"; ZeRO-{plan.zero_stage}" + (f"; offload {prose('+'.join(plan.offload))}"
                                           if plan.offload else ""))
    w.line(f"batch: global {plan.global_batch} = {m['dp'] * m['ep']} data-parallel ranks x "
           f"{plan.microbatch_size} x {plan.num_microbatches} micro-batches"
           + (f"; schedule {prose(plan.schedule)}, {_chunk_summary(plan)}" if m["pp"] > 1
              else ""))
    if predicted:
        w.line(f"predicted step time on {prose(plan.cluster)}: {predicted:.4g} s")
    if source.get("kind") == "hf_config":
        arch = (source["config"].get("architectures") or [model_name])[0]
        w.line(f"the model: {prose(arch)} (transformers) from manifest.json's config, built on "
               f"meta")
    w.blank()
    launch = plan_launch(plan.devices, plan.cluster)  # ints and fixed words only
    w.line(f"Run:  {launch} train.py --steps 100")
    if on_each_node(launch):
        w.line(f"  ({on_each_node(launch)})")
    w.line("  (or: autopar run DIR --steps 100, under the same launcher; both take its options)")
    w.line("Regenerated when plan.yaml changes; once you edit it, autopar run keeps your edits "
           "(and says so).")
    w.line('"""')
    w.blank()
    w.line("import torch")
    if plan.devices > 1:
        w.line("from torch.distributed.device_mesh import init_device_mesh")
    if plan.data_parallel_wrapper == "fully_shard" and m["ep"] == 1:
        names = (["CPUOffloadPolicy"] if plan.offloads_state else []) \
            + (["MixedPrecisionPolicy"] if _mixed_precision(plan) else []) + ["fully_shard"]
        w.line("from torch.distributed.fsdp import " + ", ".join(names))
    torch_style_imports(w, styles)
    w.blank()
    w.line("from autopar.parallel import program_steps as ap")
    for name in plan.parallelisms:  # registered parallelisms: their runtime modules
        parent, _, leaf = registered(name).runtime.rpartition(".")
        w.line(f"from {parent} import {leaf}")
    autopar_style_imports(w, styles or {})
    w.line("from autopar.train.launch import one_line_errors, train_artifact")
    w.line("from autopar.train.options import RunOptions")
    w.blank()


def _style_names(styles: dict[str, str], *candidates: str) -> str:
    used = " ".join(styles.values())
    return ", ".join(n for n in candidates if n in used)


def torch_style_imports(w: _Writer, styles: dict[str, str] | None) -> None:
    """The torch imports the tensor-parallel ``styles`` (their source text) need; None: no
    tensor parallelism. A layout with no styles (tp > 1, nothing split) still calls
    ``parallelize_module``, with nothing to do."""
    if styles is None:
        return
    if _style_names(styles, "Replicate", "Shard"):
        w.line(f"from torch.distributed.tensor import {_style_names(styles, 'Replicate', 'Shard')}")
    own = _style_names(styles, "RowwiseParallel", "SequenceParallel")
    w.line("from torch.distributed.tensor.parallel import " + (own + ", " if own else "")
           + "parallelize_module")


def autopar_style_imports(w: _Writer, styles: dict[str, str]) -> None:
    """The autopar imports the tensor-parallel ``styles`` (their source text) need."""
    if _style_names(styles, "Relayout"):
        w.line("from autopar.parallel.tensor_parallel import Relayout")
    if _style_names(styles, "GraphParallel"):
        w.line("from autopar.parallel.graph_tp import GraphParallel")
    ours = _style_names(styles, "ColumnParallel", "HeadSplit", "KvHeadReplicated", "RowParallel",
                        "SharedRotaryKey", "WholeKvProjection")
    if ours:
        w.line(f"from autopar.parallel.tp_styles import {ours}")


def _logits_statement(w: _Writer, layout: TensorParallelLayout, layers: list[str],
                      whole_logits: bool) -> None:
    """Say where a column-parallel LM head's output ends up (its style above does it; this
    says for which loss). Nothing without one, and nothing for pipeline stages, whose last
    stage always hands whole logits to the loss."""
    heads = [p for p, style in layout.styles.items() if style.startswith("ColumnParallel(")
             and not any(p == n or p.startswith(n + ".") for n in layers)]
    if layout.traced or not heads:
        return
    if whole_logits:
        w.line("# the LM head's output: gathered whole on every rank, for your own loss "
               "(autopar.parallelize)")
    else:
        w.line("# the LM head's output: split over the vocabulary, for autopar's "
               "vocabulary-parallel loss")


def _peft(w: _Writer, plan: Plan) -> None:
    w.line("# fine-tuning: the base model is frozen; the method adds (or unfreezes) what trains,")
    w.line(f"# {plan.trainable_params:,} parameters")
    w.line("PEFT = {")
    for key, value in plan.peft.items():  # Python literals (True, None), not JSON's
        w.line(f"    {key!r}: {value!r},")
    w.line("}")
    w.blank(2)
    held = plan.training_precision.param
    w.line("def adapt(model):")
    w.line('    """Apply the fine-tuning method, on meta, before the model is laid out."""')
    if held == "fp32":
        w.line("    from autopar.peft import apply_peft")
        w.blank()
        w.line("    apply_peft(model, PEFT)")
    else:
        w.line("    from autopar.peft import apply_peft, hold_frozen")
        w.blank()
        w.line("    apply_peft(model, PEFT)")
        w.line("    # frozen weights get no update, so no fp32 master copy: held as compute reads "
               "them")
        w.line(f"    hold_frozen(model, torch.{TORCH_DTYPE_NAMES[held]})")
    w.blank(2)


def _relative_styles(layout: TensorParallelLayout, layers: list[str]
                     ) -> tuple[dict[str, str] | None, dict[str, str]]:
    """(styles every layer shares, relative to the layer, or None; the other styles)."""
    per_layer: list[dict[str, str]] = []
    rest = dict(layout.styles)
    for layer in layers:
        mine = {p[len(layer) + 1:]: s for p, s in layout.styles.items()
                if p.startswith(layer + ".")}
        per_layer.append(mine)
    if layers and all(d == per_layer[0] for d in per_layer) and per_layer[0]:
        for layer in layers:
            for rel in per_layer[0]:
                rest.pop(f"{layer}.{rel}", None)
        return per_layer[0], rest
    return None, rest


def _tensor_parallel_tables(w: _Writer, layout: TensorParallelLayout, layers: list[str]) -> None:
    shared, rest = _relative_styles(layout, layers)
    if shared is not None:
        w.line("# tensor parallelism: the planner's style for each module of every layer, by "
               "path in the layer")
        w.line(f"LAYER_STYLES = {_dict(shared)}")
    w.line("# ... and for the modules outside the layers (and the layers themselves)")
    w.line(f"MODEL_STYLES = {_dict(rest)}")
    heads = {p: h for p, h in layout.heads.items()}
    w.line("# split attention modules: (query heads, key/value heads, head size); each rank "
           "runs its share")
    w.line(f"SPLIT_HEADS = {_dict(heads)}")
    if layout.traced:
        w.line("# a traced stage gets its split leaves back as modules, and cuts its fused "
               "projections' outputs per part")
        w.line(f"TRACED_LEAVES = {_list(layout.leaves)}")
        w.line(f"FUSED_PARTS = {_dict(layout.fused)}")


def mesh_axes(plan: Plan) -> tuple[str, ...]:
    """The axes of the program's device mesh, outermost first (tp innermost, as the cost
    model lays ranks out): those of more than one rank, and dp at one rank where something
    shards over it (fully_shard's offload; the dense modules over dp x ep). None for one
    device. Leaving size-1 axes out keeps every rank's coordinates on the others."""
    if plan.devices == 1:
        return ()
    m = plan.mesh
    needs_dp = m["ep"] > 1 or (plan.data_parallel_wrapper == "fully_shard"
                               and m.get("cp", 1) == 1)
    return tuple(a for a in CP_AXES if m.get(a, 1) > 1 or (a == "dp" and needs_dp))


def _mesh(w: _Writer, plan: Plan) -> None:
    p = plan.training_precision
    w.line("AUTOCAST = " + ("None  # fp32 throughout" if p.compute == "fp32"
                            else f"torch.{TORCH_DTYPE_NAMES[p.compute]}  # compute dtype; "
                                 f"{p.param} parameters, fp32 master weights and Adam states"))
    if p.loss_scaling:
        w.line("LOSS_SCALING = True  # dynamic loss scaling (fp16's narrow range)")
    w.blank(2)
    axes = mesh_axes(plan)
    w.line("def build_mesh(device):")
    if not axes:
        w.line('    """One device: ' + ("fully_shard's offload still needs a mesh, a one-rank "
                                        'one."""' if plan.offloads_state
                                        else 'nothing to lay out across ranks."""'))
        w.line("    return ap.single_process_mesh(device)" if plan.offloads_state
               else "    return None")
        w.blank(2)
        return
    shape = tuple(plan.mesh[a] for a in axes)
    names = ", ".join(f'"{a}"' for a in axes)
    call = f"init_device_mesh(device, {shape}, mesh_dim_names=({names}{',' if len(axes) == 1 else ''}))"
    if dp_axis(plan) == DP_CP:
        w.line(f"    mesh = {call}")
        context_parallel_mesh(w)
        w.line("    return mesh")
    else:
        w.line(f"    return {call}")
    w.blank(2)


def _layer_plan(w: _Writer, plan: Plan, layout: TensorParallelLayout, layers: list[str]) -> None:
    """LAYER_STYLES (one layer plan, applied to every layer) and MODEL_STYLES (the modules
    around the layers). A pipeline's chunk-boundary relayouts come from the plan
    (``ap.chunk_boundaries``), not from this table."""
    shared, rest = _relative_styles(layout, layers)
    boundaries = chunk_boundary_styles(plan) if layout.traced and plan.sequence_parallel \
        else {}
    for path, style in boundaries.items():
        if rest.get(path) == style:
            rest.pop(path)
    if shared is not None:
        w.line("# tensor parallelism: one layer plan (module paths in the layer), for every layer")
        w.line(f"LAYER_STYLES = {_dict(shared)}")
    note = ("  # ... and the modules around the layers" if shared is not None
            else "  # tensor parallelism: each module's style") + (
        " (chunk boundaries: from the plan)" if boundaries else "")
    table = _dict(rest)
    w.line("MODEL_STYLES = " + (table.replace("{", "{" + note, 1) if rest else table + note))


def recompute_rule(plan: Plan) -> dict[str, str]:
    """The plan's per-layer recompute modes as a rule: each block type's most frequent mode,
    then the layers that differ, consecutive ones as one "prefix.A-B" range."""
    layer_modes = [(b, mode) for b, mode in zip(plan.model.blocks, plan.recompute, strict=True)
                   if b.is_layer]
    rule: dict[str, str] = {}
    for kind in dict.fromkeys(b.kind for b, _ in layer_modes):
        rule[kind] = Counter(mode for b, mode in layer_modes if b.kind == kind).most_common(1)[0][0]
    runs: list[tuple[str, int, int, str]] = []  # (prefix, first, last, mode); first -1: a path
    for block, mode in layer_modes:
        if mode == rule[block.kind]:
            continue
        prefix, _, index = block.name.rpartition(".")
        if not index.isdigit():
            runs.append((block.name, -1, -1, mode))
            continue
        last = runs[-1] if runs else None
        if last is not None and last[0] == prefix and last[2] == int(index) - 1 and last[3] == mode:
            runs[-1] = (prefix, last[1], int(index), mode)
        else:
            runs.append((prefix, int(index), int(index), mode))
    for prefix, first, last, mode in runs:
        key = prefix if first < 0 else f"{prefix}.{first}" if first == last \
            else f"{prefix}.{first}-{last}"
        rule[key] = mode
    return rule


def _recompute_rule(w: _Writer, plan: Plan) -> None:
    rule = recompute_rule(plan)
    w.line("# recompute (full | selective | op | none) by block type, then the layers that differ")
    items = [f"{json.dumps(k)}: {json.dumps(v)}" for k, v in rule.items()]
    lines, current = [], "RECOMPUTE = {"
    for i, item in enumerate(items):
        piece = item + ("}" if i == len(items) - 1 else ",")
        if len(current) + len(piece) + 1 > 99 and not current.endswith("{"):
            lines.append(current)
            current = " " * len("RECOMPUTE = {") + piece
        else:
            current += ("" if current.endswith("{") else " ") + piece
    lines.append(current)
    for line in lines:
        w.line(line)


def _tp_statements(w: _Writer, plan: Plan, layout: TensorParallelLayout, target: str,
                   shared: bool, pipeline: bool) -> None:
    if layout.heads:
        w.line(f"    ap.split_heads({target}, plan, mesh)  # attention runs its share of the heads")
    if pipeline:
        w.line(f"    ap.prepare_stage({target}, original, plan)  # traced: split leaves back as "
               "modules")
    if shared:
        w.line(f"    for layer in ap.layers({target}, plan):  # tensor parallelism: the layer plan")
        w.line(f"        parallelize_module({target}.get_submodule(layer), mesh[\"tp\"], "
               "LAYER_STYLES)")
    boundaries = pipeline and plan.sequence_parallel and bool(chunk_boundary_styles(plan))
    styles = "MODEL_STYLES | ap.chunk_boundaries(plan)" if boundaries else "MODEL_STYLES"
    w.line(f"    parallelize_module({target}, mesh[\"tp\"], ap.present({target}, {styles}))")


def _recompute_statements(w: _Writer, target: str) -> None:
    w.line(f"    for layer, mode in ap.recompute_modes({target}, plan, RECOMPUTE).items():")
    w.line(f"        ap.recompute({target}, layer, mode, plan.seq)  # op: torchtitan's op-level "
           "policy")


def _mixed_precision(plan: Plan) -> str:
    """fully_shard's mp_policy argument, or "" for fp32 throughout (its default)."""
    p = plan.training_precision
    if p.param == "fp32" and p.reduce == "fp32":
        return ""
    return (f"MixedPrecisionPolicy(param_dtype=torch.{TORCH_DTYPE_NAMES[p.param]}, "
            f"reduce_dtype=torch.{TORCH_DTYPE_NAMES[p.reduce]})")


def _shard_statements(w: _Writer, plan: Plan, target: str) -> None:
    offload = plan.state_offloads
    if plan.data_parallel_wrapper != "fully_shard":
        return
    what = {3: "parameters gathered again for the backward",
            2: "parameters kept gathered through the backward"
            }.get(plan.zero_stage, "one replica, its states offloaded")
    axis = dp_axis(plan)
    w.line(f"    # ZeRO-{plan.zero_stage}: fully_shard per layer over mesh[\"{axis}\"], {what}")
    args = [f"mesh=mesh[\"{axis}\"]", f"reshard_after_forward={plan.zero_stage == 3}"]
    if offload:
        w.line(f"    # offload ({prose('+'.join(offload))}): parameters, gradients and the optimizer "
               "step live on the host")
        w.line("    ap.use_host_cores()  # the host's AdamW step: this rank's share of its cores")
        args.append("offload_policy=CPUOffloadPolicy(pin_memory=torch.cuda.is_available())")
    if _mixed_precision(plan):
        w.line(f"    mp = {_mixed_precision(plan)}")
        args.append("mp_policy=mp")
    _call_lines(w, "    fsdp = dict(", args, ")")
    w.line(f"    for layer in ap.layers({target}, plan):")
    w.line(f"        fully_shard({target}.get_submodule(layer), **fsdp)")
    w.line(f"    fully_shard({target}, **fsdp)")


def _parallelism_statements(w: _Writer, plan: Plan, target: str) -> None:
    """The registered parallelisms the plan chose, each its runtime's ``apply`` with the
    plan's value (autopar.plan.parallelisms)."""
    for name, value in plan.parallelisms.items():
        p = registered(name)
        leaf = p.runtime.rpartition(".")[2]
        # the value through repr: a bool, int or str the plan's validation checked
        w.line(f"    # {prose(p.what)} ({name} = {prose(repr(value))})")
        w.line(f"    {leaf}.apply({target}, mesh, plan, {value!r})")


def _call_lines(w: _Writer, opening: str, args: list[str], closing: str) -> None:
    """``opening`` + ``args`` + ``closing`` wrapped at 99 columns, continued under the first
    argument."""
    current = opening
    for i, arg in enumerate(args):
        piece = arg + (closing if i == len(args) - 1 else ",")
        if len(current) + len(piece) + 1 > 99 and not current.endswith("("):
            w.line(current)
            current = " " * len(opening) + piece
        else:
            current += ("" if current.endswith("(") else " ") + piece
    w.line(current)


def _parallelize(w: _Writer, plan: Plan, layout: TensorParallelLayout | None) -> None:
    w.blank(2)
    w.line("def parallelize(model, mesh, plan):")
    w.line('    """Lay the model out as planned: on meta before any weight exists (autopar run), '
           'or on the')
    w.line('    weights of your model (autopar.parallelize)."""')
    if layout is not None:
        _tp_statements(w, plan, layout, "model",
                       _relative_styles(layout, layer_names(plan))[0] is not None, pipeline=False)
    if plan.mesh["ep"] > 1:
        w.line("    # expert parallelism over mesh[\"ep\"]: each rank holds its experts; tokens "
               "travel by all-to-all")
        w.line("    experts = ap.expert_parallel(model, mesh)")
    if plan.mesh.get("cp", 1) > 1:
        context_parallel_statements(w, plan)
    _recompute_statements(w, "model")
    if plan.mesh["ep"] > 1:
        w.line("    # data parallelism: dense modules over dp x ep, experts over dp")
        w.line("    ap.shard_experts(model, mesh, plan, experts)")
    else:
        _shard_statements(w, plan, "model")
    _parallelism_statements(w, plan, "model")
    w.line("    return model")


def _pipeline(w: _Writer, plan: Plan, layout: TensorParallelLayout | None) -> None:
    w.blank(2)
    w.line("def parallelize_stage(stage, mesh, plan, original):")
    w.line('    """Lay out a stage this rank runs: the plan\'s chunk c, traced from original, on pp '
           'rank c % pp."""')
    if layout is not None:
        _tp_statements(w, plan, layout, "stage",
                       _relative_styles(layout, layer_names(plan))[0] is not None, pipeline=True)
    if plan.mesh["ep"] > 1:
        w.line("    # expert parallelism over mesh[\"ep\"]: the stage's experts back as the "
               "original modules, each rank holding its experts; tokens travel by all-to-all")
        w.line("    experts = ap.stage_expert_parallel(stage, original, mesh)")
    if plan.mesh.get("cp", 1) > 1:
        context_parallel_statements(w, plan, stage=True)
    _recompute_statements(w, "stage")
    if plan.mesh["ep"] > 1:
        w.line("    # data parallelism: dense modules over dp x ep, experts over dp (ZeRO-0/1: the "
               "runtime averages the gradients after each schedule step)")
        w.line("    ap.shard_experts(stage, mesh, plan, experts)")
    else:
        _shard_statements(w, plan, "stage")
    _parallelism_statements(w, plan, "stage")
    w.line("    return stage")


def _replicate(w: _Writer, plan: Plan) -> None:
    """``replicate`` where the model is wrapped after its weights exist (DDP, ZeRO-0/1); none
    where parallelize already did all (fully_shard), there is one replica, or a pipeline's
    runtime averages its stages' gradients after each schedule step."""
    if plan.mesh["ep"] > 1:
        body = "    return ap.replicate_experts(model, mesh, plan)"
    elif plan.data_parallel_wrapper == "ddp" and plan.mesh["pp"] == 1:
        body = ("    return torch.nn.parallel.DistributedDataParallel(model, "
                f"process_group=mesh[\"{dp_axis(plan)}\"].get_group())")
    else:
        return
    w.blank(2)
    w.line("def replicate(model, mesh, plan):")
    w.line('    """After the weights exist: data-parallel replicas (ZeRO-0/1)."""')
    w.line(body)


def _optimizer(w: _Writer, plan: Plan) -> None:
    w.blank(2)
    w.line("def build_optimizer(param_groups, mesh, hp):")
    zero1 = plan.shards_optimizer and plan.mesh["ep"] == 1
    doc = "hp: autopar run's --lr, --betas, --eps; groups carry their weight decay"
    if plan.mesh["ep"] > 1 and plan.zero_stage == 1 and experts_use_ddp(plan):
        w.line('    """AdamW with its states sharded (ZeRO-1): the dense parameters\' over dp x ep, '
               'the experts\'')
        w.line('    over dp; ' + doc + '."""')
        w.line("    return ap.expert_zero_optimizer(param_groups, mesh, torch.optim.AdamW, "
               "lr=hp.lr, betas=hp.betas,")
        w.line("                                    eps=hp.eps)")
    elif zero1:
        w.line('    """AdamW with its states sharded over dp (ZeRO-1); ' + doc + '."""')
        w.line("    from torch.distributed.optim import ZeroRedundancyOptimizer")
        w.blank()
        w.line("    return ZeroRedundancyOptimizer(param_groups, torch.optim.AdamW, lr=hp.lr, "
               "betas=hp.betas, eps=hp.eps,")
        w.line(f"                                   process_group=mesh[\"{dp_axis(plan)}\"]"
               ".get_group())")
    else:
        w.line('    """AdamW; ' + doc + '."""')
        w.line("    return torch.optim.AdamW(param_groups, lr=hp.lr, betas=hp.betas, eps=hp.eps)")
