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

from torch import nn

from autopar.artifact.load import load_program
from autopar.codegen.cp_program import (
    context_parallel_mesh,
    context_parallel_statements,
    context_parallel_table,
    dp_axis,
)
from autopar.cost.precision import TORCH_DTYPE_NAMES
from autopar.models.source import build_from_source
from autopar.parallel.expert_parallel import experts_use_ddp
from autopar.parallel.pipeline import chunk_ranges
from autopar.parallel.style_spec import StyleSpec
from autopar.parallel.tensor_parallel import (
    TensorParallelLayout,
    layer_names,
    tensor_parallel_layout,
)
from autopar.peft import apply_peft
from autopar.plan import Plan
from autopar.plan.launch import on_each_node, plan_launch


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
    which."""
    source = source or {}
    m = plan.mesh
    layout = None
    if m["tp"] > 1:
        layout = tensor_parallel_layout(model, plan, traced=m["pp"] > 1,
                                        whole_logits=whole_logits)
    layers = [n for n in layer_names(plan)]
    seq = plan.seq
    w = _Writer()
    _header(w, plan, source, model_name or type(model).__name__,
            layout.styles if layout is not None else None)
    _mesh(w, plan)
    if plan.peft:
        _peft(w, plan)
    if layout is not None:
        _tensor_parallel_tables(w, layout, layers)
        _logits_statement(w, layout, layers, whole_logits)
    recompute = {b.name: mode for b, mode in zip(plan.model.blocks, plan.recompute, strict=True)
                 if mode != "none" and b.is_layer}
    w.line("# the repeated layers: each its own recompute and fully_shard unit")
    w.line(f"LAYERS = {_list(layers)}")
    w.line(f"RECOMPUTE = {_dict(recompute)}  # layer -> full | selective | op")
    w.line(f"SEQ = {int(seq)}  # tokens per sequence: selective recompute spots the score tensors")
    if m["pp"] > 1:
        _pipeline(w, plan, layout)
    else:
        _parallelize(w, plan, layout)
    _replicate(w, plan)
    _optimizer(w, plan)
    w.blank(2)
    w.line('if __name__ == "__main__":  # launched as the docstring\'s Run: line says')
    w.line("    import os")
    w.line("    import sys")
    w.blank()
    w.line("    from autopar.cli import main")
    w.blank()
    w.line('    main(["run", os.path.dirname(os.path.abspath(__file__)), *sys.argv[1:]])')
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
    axes = "pp, dp, cp, ep, tp" if m.get("cp", 1) > 1 else "pp, dp, ep, tp"
    w.line(f"mesh ({axes}) = ({', '.join(str(m[a]) for a in axes.split(', '))}), tp innermost; "
           f"ZeRO-{plan.zero_stage}" + (f"; offload {prose('+'.join(plan.offload))}"
                                        if plan.offload else ""))
    w.line(f"batch: global {plan.global_batch} = {m['dp'] * m['ep']} data-parallel ranks x "
           f"{plan.microbatch_size} x {plan.num_microbatches} micro-batches"
           + (f"; schedule {prose(plan.schedule)}" if m["pp"] > 1 else ""))
    if predicted:
        w.line(f"predicted step time on {prose(plan.cluster)}: {predicted:.4g} s")
    w.blank()
    launch = plan_launch(plan.devices, plan.cluster)  # ints and fixed words only
    w.line(f"Run:  {launch} train.py --steps 100")
    if on_each_node(launch):
        w.line(f"  ({on_each_node(launch)})")
    w.line("  (or: autopar run DIR --steps 100, under the same launcher)")
    w.line("autopar compile and autopar run regenerate this file when plan.yaml changes; once "
           "you edit it,")
    w.line("autopar run keeps your edits (and says so). Delete it to regenerate.")
    w.line('"""')
    w.blank()
    w.line("import torch")
    if plan.devices > 1:
        w.line("from torch.distributed.device_mesh import init_device_mesh")
    if plan.data_parallel_wrapper == "fully_shard" and m["ep"] == 1:
        offload = plan.offloads_state
        w.line("from torch.distributed.fsdp import "
               + ("CPUOffloadPolicy" if offload else "OffloadPolicy")
               + ", MixedPrecisionPolicy, fully_shard")
    torch_style_imports(w, styles)
    w.blank()
    w.line("from autopar.parallel import program_steps as ap")
    autopar_style_imports(w, styles or {})
    w.blank()
    if source.get("kind") == "hf_config":
        arch = (source["config"].get("architectures") or [model_name])[0]
        w.line(f"# the model: {prose(arch)} (transformers) from manifest.json's config, built "
               f"on meta")
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
                        "WholeKvProjection")
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


def _mesh(w: _Writer, plan: Plan) -> None:
    m = plan.mesh
    shape = (m["pp"], m["dp"], m["ep"], m["tp"])
    offload = plan.offloads_state
    if m.get("cp", 1) > 1:
        context_parallel_table(w, plan)
    else:
        w.line(f"MESH = {{\"pp\": {m['pp']}, \"dp\": {m['dp']}, \"ep\": {m['ep']}, "
               f"\"tp\": {m['tp']}}}")
    p = plan.training_precision
    w.line(f"# precision: {p.compute} compute, {p.param} parameters as computed with, "
           f"{p.reduce} gradient reductions; fp32 master weights and optimizer states")
    w.line("AUTOCAST = " + ("None  # fp32 throughout" if p.compute == "fp32"
                            else f"torch.{TORCH_DTYPE_NAMES[p.compute]}  # autocast's compute dtype"))
    w.line(f"LOSS_SCALING = {p.loss_scaling}  # dynamic loss scaling (fp16's narrow range)")
    w.blank(2)
    if m.get("cp", 1) > 1:
        context_parallel_mesh(w, plan)
        return
    w.line("def build_mesh(device):")
    w.line('    """The named device mesh over the launched processes (tp innermost)."""')
    if plan.devices > 1:
        w.line(f"    return init_device_mesh(device, {shape}, "
               "mesh_dim_names=(\"pp\", \"dp\", \"ep\", \"tp\"))")
    elif offload:
        w.line("    # one device, but fully_shard's offload needs a mesh: a one-rank one")
        w.line("    return ap.single_process_mesh(device)")
    else:
        w.line("    return None  # one device: nothing to lay out across ranks")
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


def _tp_statements(w: _Writer, target: str, shared: bool, pipeline: bool) -> None:
    w.line(f"    # tensor parallelism over mesh[\"tp\"] ({'per stage: ' if pipeline else ''}"
           "column/row splits, the planner's layout)")
    w.line(f"    ap.localize_heads({target}, SPLIT_HEADS, MESH[\"tp\"])")
    if pipeline:
        w.line(f"    ap.prepare_stage({target}, original, TRACED_LEAVES, FUSED_PARTS)")
    if shared:
        w.line("    for layer in ap.present(" + target + ", LAYERS):")
        w.line(f"        parallelize_module({target}.get_submodule(layer), mesh[\"tp\"], "
               "LAYER_STYLES)")
    w.line(f"    parallelize_module({target}, mesh[\"tp\"], ap.present({target}, MODEL_STYLES))")


def _recompute_statements(w: _Writer, target: str, pipeline: bool) -> None:
    w.line("    # recompute: full checkpoints the layer, selective its attention core only, op "
           "keeps every other projection's and attention's outputs")
    w.line("    for layer, mode in " + (f"ap.present({target}, RECOMPUTE)" if pipeline
                                         else "RECOMPUTE") + ".items():")
    w.line(f"        ap.recompute({target}, layer, mode, SEQ)")


def _shard_statements(w: _Writer, plan: Plan, target: str) -> None:
    offload = plan.state_offloads
    reshard = plan.zero_stage == 3
    kind = plan.data_parallel_wrapper
    if kind != "fully_shard":
        return
    what = {3: "each layer's parameters gathered for its forward and its backward",
            2: "parameters kept gathered from the forward to the end of the backward"
            }.get(plan.zero_stage, "one replica, its states offloaded")
    axis = dp_axis(plan)
    w.line(f"    # data parallelism: ZeRO-{plan.zero_stage} over mesh[\"{axis}\"] "
           f"({plan.mesh['dp'] * plan.mesh.get('cp', 1)} ranks)")
    w.line(f"    # fully_shard per layer: {what}")
    if offload:
        w.line(f"    # offload ({prose('+'.join(offload))}): parameters, gradients and the optimizer "
               "step live on the host")
        w.line("    policy = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())")
        w.line("    ap.use_host_cores()  # the host's AdamW step: this rank's share of its cores")
    else:
        w.line("    policy = OffloadPolicy()")
    p = plan.training_precision
    if p.param == "fp32" and p.reduce == "fp32":
        w.line("    mp = MixedPrecisionPolicy()  # fp32")
    else:
        w.line(f"    mp = MixedPrecisionPolicy(param_dtype=torch.{TORCH_DTYPE_NAMES[p.param]}, "
               f"reduce_dtype=torch.{TORCH_DTYPE_NAMES[p.reduce]})")
    w.line(f"    for layer in ap.present({target}, LAYERS):")
    w.line(f"        fully_shard({target}.get_submodule(layer), mesh=mesh[\"{axis}\"], "
           f"reshard_after_forward={reshard},")
    w.line("                    offload_policy=policy, mp_policy=mp)")
    w.line(f"    fully_shard({target}, mesh=mesh[\"{axis}\"], reshard_after_forward={reshard}, "
           "offload_policy=policy,")
    w.line("                mp_policy=mp)")


def _parallelize(w: _Writer, plan: Plan, layout: TensorParallelLayout | None) -> None:
    w.blank(2)
    w.line("def parallelize(model, mesh, plan):")
    w.line('    """Lay the model out as planned: on meta before any weight exists (autopar run), '
           'or on the')
    w.line('    weights of your model (autopar.parallelize)."""')
    if layout is not None:
        _tp_statements(w, "model", _relative_styles(layout, layer_names(plan))[0] is not None,
                       pipeline=False)
    if plan.mesh["ep"] > 1:
        w.line("    # expert parallelism over mesh[\"ep\"]: each rank holds its experts; tokens "
               "travel by all-to-all")
        w.line("    experts = ap.expert_parallel(model, mesh)")
    if plan.mesh.get("cp", 1) > 1:
        context_parallel_statements(w, plan)
    _recompute_statements(w, "model", pipeline=False)
    if plan.mesh["ep"] > 1:
        w.line("    # data parallelism: dense modules over dp x ep, experts over dp")
        w.line("    ap.shard_experts(model, mesh, plan, experts)")
    else:
        _shard_statements(w, plan, "model")
    w.line("    return model")


def _pipeline(w: _Writer, plan: Plan, layout: TensorParallelLayout | None) -> None:
    chunks = [list(c) for c in chunk_ranges(plan)]
    w.line("# pipeline: the model is traced and cut into chunks of blocks; chunk c runs on "
           "pipeline rank c % pp")
    w.line(f"PIPELINE = {{\"chunks\": {chunks}, \"schedule\": {json.dumps(plan.schedule)}, "
           f"\"microbatches\": {plan.num_microbatches}}}")
    w.blank(2)
    w.line("def parallelize_stage(stage, mesh, plan, original):")
    w.line('    """Lay out one of this rank\'s pipeline stages (a traced piece of ``original``), '
           'on meta')
    w.line('    (autopar run) or on the weights (autopar.parallelize)."""')
    if layout is not None:
        _tp_statements(w, "stage", _relative_styles(layout, layer_names(plan))[0] is not None,
                       pipeline=True)
    if plan.mesh["ep"] > 1:
        w.line("    # expert parallelism over mesh[\"ep\"]: the stage's experts back as the "
               "original modules, each rank holding its experts; tokens travel by all-to-all")
        w.line("    experts = ap.stage_expert_parallel(stage, original, mesh)")
    _recompute_statements(w, "stage", pipeline=True)
    if plan.mesh["ep"] > 1:
        w.line("    # data parallelism: dense modules over dp x ep, experts over dp (ZeRO-0/1: the "
               "runtime averages the gradients after each schedule step)")
        w.line("    ap.shard_experts(stage, mesh, plan, experts)")
    else:
        _shard_statements(w, plan, "stage")
    w.line("    return stage")


def _replicate(w: _Writer, plan: Plan) -> None:
    w.blank(2)
    w.line("def replicate(model, mesh, plan):")
    w.line('    """After the weights exist: data-parallel replicas (ZeRO-0/1)."""')
    kind = plan.data_parallel_wrapper
    if plan.mesh["ep"] > 1:
        w.line("    return ap.replicate_experts(model, mesh, plan)")
    elif kind == "ddp" and plan.mesh["pp"] > 1:
        w.line("    # pipeline stages: the runtime averages their gradients over dp after each "
               "schedule step")
        w.line("    return model")
    elif kind == "ddp":
        w.line("    return torch.nn.parallel.DistributedDataParallel(model, "
               f"process_group=mesh[\"{dp_axis(plan)}\"].get_group())")
    else:
        w.line("    return model  # " + ("fully_shard already shards it" if kind == "fully_shard"
                                          else "one replica"))


def _optimizer(w: _Writer, plan: Plan) -> None:
    w.blank(2)
    w.line("def build_optimizer(param_groups, mesh, hp):")
    zero1 = plan.shards_optimizer and plan.mesh["ep"] == 1
    doc = ("hp: the run's settings (autopar run --lr, --betas, --eps); each group carries its "
           "weight decay")
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
        w.line('    """AdamW (fp32 states); ' + doc + '."""')
        w.line("    return torch.optim.AdamW(param_groups, lr=hp.lr, betas=hp.betas, eps=hp.eps)")
