"""Pipeline parallelism with torch.distributed.pipelining: the model is traced and split into
stage modules at the plan's block boundaries, and run by the plan's schedule."""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from autopar.errors import PlanError
from autopar.parallel.expert_parallel import experts_use_ddp, find_experts, sync_expert_grads
from autopar.parallel.init import InitReport, materialize
from autopar.parallel.policies import data_parallel_kind
from autopar.parallel.split_backward import gather_for_split_backward
from autopar.parallel.stage_experts import check_stage_experts
from autopar.parallel.tensor_parallel import tied_modules
from autopar.parallel.traced_stage import drop_metadata_asserts
from autopar.plan import Plan

if TYPE_CHECKING:
    from autopar.weights.hf_weights import HFCheckpoint

def chunk_ranges(plan: Plan) -> list[tuple[int, int]]:
    """Block ranges of the pipeline chunks: the plan's stages, each cut in ``virtual_stages``
    parts for the interleaved schedule (chunk c runs on rank c % pp): :meth:`Plan.chunk_ranges`."""
    return plan.chunk_ranges()


def split_spec(plan: Plan, chunks: list[tuple[int, int]], model: nn.Module | None = None
               ) -> dict:
    """Where torch's tracer cuts the model: at the beginning of each chunk's first layer. A
    chunk that starts with the tail (final norm, LM head) begins at the first module with
    parameters registered after the last layer when ``model`` is given, else at the end of the
    layer before it (which must not itself start a chunk)."""
    from torch.distributed.pipelining import SplitPoint

    blocks = plan.model.block_names
    layers = set(plan.layers)
    spec = {}
    for start, _ in chunks[1:]:
        name = blocks[start]
        if name in layers:
            spec[name] = SplitPoint.BEGINNING
        elif name == "tail" and blocks[start - 1] in layers:
            first = _first_tail_module(model, blocks[start - 1]) if model is not None else None
            if first is not None:
                spec[first] = SplitPoint.BEGINNING
            elif blocks[start - 1] in spec:
                raise PlanError(f"cannot cut the pipeline both before and after "
                                f"{blocks[start - 1]}; give that chunk another block")
            else:
                spec[blocks[start - 1]] = SplitPoint.END
        else:
            raise PlanError(f"cannot start a pipeline stage at block '{name}'; move the stage "
                            f"boundary onto a layer")
    return spec


def _first_tail_module(model: nn.Module, last_layer: str) -> str | None:
    """The first module with its own parameters registered after ``last_layer`` (and outside
    it): the final norm or the LM head."""
    after = False
    for name, module in model.named_modules():
        if name == last_layer:
            after = True
            continue
        if not after or name.startswith(last_layer + "."):
            continue
        if any(True for _ in module.parameters(recurse=False)):
            return name
    return None


def _schedule_class(name: str):
    from torch.distributed.pipelining import (
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
        ScheduleInterleavedZeroBubble,
    )

    return {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B,
            "zero_bubble": ScheduleInterleavedZeroBubble}[name]


def build_pipeline(model: nn.Module, plan: Plan, pp_mesh: DeviceMesh, device: str,
                   example: torch.Tensor, loss_fn, lay_out=None, *,
                   chunks: list[tuple[int, int]] | None = None, schedule: str | None = None,
                   microbatches: int | None = None, inputs: dict | None = None
                   ) -> tuple[list, object, list[nn.Module]]:
    """(this rank's PipelineStages, the schedule, their modules). ``lay_out(stage_module)``
    (the program's ``parallelize_stage``) lays out each stage module of this rank, on meta,
    before its PipelineStage is built. ``chunks``, ``schedule`` and ``microbatches`` default
    to the plan's. ``inputs``: keyword inputs the trace takes besides ``example`` (context
    parallelism's position ids, :func:`autopar.parallel.cp_stage.trace_positions`)."""
    from torch.distributed.pipelining import pipeline

    chunks = chunks if chunks is not None else chunk_ranges(plan)
    schedule = schedule or plan.schedule
    microbatches = microbatches or plan.num_microbatches
    kwargs = {"use_cache": False} if hasattr(model, "config") else {}
    kwargs = {**kwargs, **(inputs or {})} or None
    experts = []
    if plan.mesh["ep"] > 1:
        experts = find_experts(model)  # before the trace: the lay-out must split each one
    _untie(model)
    # traced on the whole, unsplit model: tensor parallelism is applied to the stage modules
    # after the split, and keeps the global shapes the trace baked in (see tensor_parallel)
    pipe = pipeline(model, mb_args=(example,), mb_kwargs=kwargs,
                    split_spec=split_spec(plan, chunks, model))
    _thread_skip_inputs(pipe)
    if pipe.num_stages != len(chunks):
        raise PlanError(f"splitting the model gave {pipe.num_stages} stages, the plan needs "
                        f"{len(chunks)}")
    pp, rank = plan.mesh["pp"], pp_mesh.get_local_rank()
    indices = [i for i in range(len(chunks)) if i % pp == rank]
    for i in indices:  # the trace ran in fp32; autocast changes dtypes its asserts fixed
        drop_metadata_asserts(pipe.get_stage_module(i))
    if lay_out is not None:
        for i in indices:
            lay_out(pipe.get_stage_module(i))
    if experts:
        check_stage_experts([pipe.get_stage_module(i) for i in indices], experts)
    group = pp_mesh.get_group()
    # a meta stage module stays on meta here (build_stage moves only real tensors);
    # materialize_stages allocates it
    stages = [pipe.build_stage(i, torch.device(device), group) for i in indices]
    for stage in stages:
        retarget_graph_devices(stage.submod, torch.device(device))
        if schedule == "zero_bubble":  # its split backward must see the gathered weights
            gather_for_split_backward(stage)
    cls = _schedule_class(schedule)
    multi = schedule in ("interleaved", "zero_bubble")
    runner = cls(stages if multi else stages[0], n_microbatches=microbatches, loss_fn=loss_fn)
    return stages, runner, [s.submod for s in stages]


def _thread_skip_inputs(pipe) -> None:
    """Pass every value a stage reads from a stage before its neighbour through the stages in
    between (an extra input and output each).

    Hugging Face decoders make the rotary tables and the attention mask once, before the first
    layer, and hand them to every layer: traced and split, a third stage would read them from
    the first, a skip connection torch's schedules refuse ("Backward of skip connections not
    supported", or non-adjacent stages under the interleaved schedules). Threaded through,
    every stage talks to its neighbours only.
    """
    gm = pipe.split_gm
    graph = gm.graph
    calls = [n for n in graph.nodes if n.op == "call_module" and n.target.startswith("submod_")]
    index = {n: i for i, n in enumerate(calls)}

    def producer(node) -> int | None:
        if node in index:
            return index[node]
        if node.op == "call_function" and node.target is operator.getitem and \
                node.args[0] in index:
            return index[node.args[0]]
        return None

    relayed: dict = {}  # (value node, stage) -> the node holding it after that stage

    def relay(value, stage: int, meta: dict):
        """``value`` as output of stage ``stage`` (which gets it as an extra input); ``meta``
        is the consuming stage's placeholder meta (its "val" sizes the buffers)."""
        key = (value, stage)
        if key in relayed:
            return relayed[key]
        call = calls[stage]
        sub = getattr(gm, call.target)
        sub_graph = sub.graph
        placeholders = [n for n in sub_graph.nodes if n.op == "placeholder"]
        received = value in call.args  # the stage reads it already: send on what it gets (a
        if received:                   # second receive of one send would desynchronise)
            extra = placeholders[list(call.args).index(value)]
        else:
            with sub_graph.inserting_after(placeholders[-1]):
                extra = sub_graph.placeholder(f"relay_{len(placeholders)}")
            extra.meta = dict(meta)  # stages size their buffers from meta["val"]
        out = next(n for n in sub_graph.nodes if n.op == "output")
        result = out.args[0]
        before = call.meta.get("val")
        if isinstance(result, (tuple, list)):
            out.args = (tuple(result) + (extra,),)
            position = len(result)
            call.meta["val"] = (*before, meta.get("val")) if before is not None else None
        else:  # a single output becomes a pair: its users read item 0
            out.args = ((result, extra),)
            position = 1
            users = list(call.users)
            with graph.inserting_after(call):
                first = graph.call_function(operator.getitem, (call, 0))
            first.meta = dict(call.meta)
            for user in users:
                user.replace_input_with(call, first)
            call.meta["val"] = (before, meta.get("val"))
        sub.recompile()
        if not received:
            call.args = call.args + (value,)
        with graph.inserting_after(call):
            held = graph.call_function(operator.getitem, (call, position))
        held.meta = dict(meta)
        relayed[key] = held
        return held

    for k, call in enumerate(calls):
        own = [n for n in getattr(gm, call.target).graph.nodes if n.op == "placeholder"]
        for i, placeholder in enumerate(own):
            a = call.args[i]  # read afresh: relaying rewires the readers of earlier stages
            if not isinstance(a, torch.fx.Node):
                continue
            j = producer(a)
            if j is None and a.op == "placeholder":
                j = -1  # a model input read after the first stage
            if j is not None and j < k - 1:
                for m in range(j + 1, k):
                    a = relay(a, m, placeholder.meta)
                call.update_arg(i, a)
    # the model's outputs come from the last stage only (the schedule returns its output):
    # an output an earlier stage computed (a MoE layer's router logits that Hugging Face
    # collects with a hook) is relayed to it too
    output = next(n for n in graph.nodes if n.op == "output")
    last = len(calls) - 1

    def to_last(value):
        j = producer(value)
        if j is None or j >= last:
            return value
        meta = _produced_meta(gm, value)
        for m in range(j + 1, last + 1):
            value = relay(value, m, meta)
        return value

    output.args = (torch.fx.node.map_arg(output.args[0], to_last),)
    for k, call in enumerate(calls[1:], start=1):
        _receive_in_send_order(gm, call, calls[k - 1])
    graph.lint()
    gm.recompile()


def _produced_meta(gm, value) -> dict:
    """The meta (its "val" sizes a receive buffer) of the stage output ``value`` reads: item
    ``i`` of a stage's outputs, or its only output."""
    call, index = (value.args[0], value.args[1]) if value.op == "call_function" and \
        value.target is operator.getitem else (value, None)
    result = next(n for n in getattr(gm, call.target).graph.nodes if n.op == "output").args[0]
    node = result[index] if index is not None else result
    return dict(node.meta) if isinstance(node, torch.fx.Node) else {}


def _receive_in_send_order(gm, call, before) -> None:
    """Put the inputs of stage ``call`` in the order its neighbour ``before`` sends them.

    A stage sends its outputs in output order and the next one posts its receives in
    placeholder order; gloo pairs them in posting order. A stage that receives a neighbour's
    later output before an earlier one (a relayed value placed before one the neighbour
    computed itself, such as a MoE layer's router logits) would read each tensor into another
    one's buffer."""
    def sent_at(arg) -> int:
        if isinstance(arg, torch.fx.Node) and arg.op == "call_function" and \
                arg.target is operator.getitem and arg.args[0] is before:
            return int(arg.args[1])
        return -1  # a model input (the first stages) or a constant
    sub = getattr(gm, call.target)
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    order = sorted(range(len(call.args)), key=lambda i: sent_at(call.args[i]))
    if order == list(range(len(call.args))) or len(placeholders) != len(call.args):
        return
    first_body = next(n for n in sub.graph.nodes if n.op != "placeholder")
    for i in order:
        first_body.prepend(placeholders[i])
    call.args = tuple(call.args[i] for i in order)
    sub.recompile()


def retarget_graph_devices(stage: nn.Module, device: torch.device) -> None:
    """Rewrite every meta device that tracing the meta model baked into ``stage``'s graphs,
    nested ones included, to ``device``.

    build_stage's own rewrite (torch's ``_modify_graph_op_device``) changes only ``device=``
    keywords, in the graphs it reaches through call_module nodes; a transformers model also
    bakes the device into positional arguments (``aten.to.device``), and its stage forward
    then fails with "Tensor on device meta". Every graph module the stage holds is visited.

    Code that branched on the device while tracing took the non-CPU branch on meta; the one
    such branch that fails elsewhere is transformers' grouped-mm experts counting tokens per
    expert with ``histc`` on integers, which CPU histc refuses: on CPU its input is cast to
    float, as transformers' own CPU branch does.
    """
    for module in stage.modules():
        graph = getattr(module, "graph", None)
        if not isinstance(graph, torch.fx.Graph):
            continue
        changed = device.type in ("cpu", "mps") and _float_histc(graph)

        def swap(arg: object) -> object:
            nonlocal changed
            if isinstance(arg, torch.device) and arg.type == "meta":
                changed = True
                return device
            return arg

        for node in graph.nodes:
            node.args = torch.fx.node.map_aggregate(node.args, swap)
            node.kwargs = torch.fx.node.map_aggregate(node.kwargs, swap)
        if changed:
            # an unflattened InterpreterModule keeps its generated code outside _modules
            code = module if isinstance(module, torch.fx.GraphModule) else \
                module.__dict__.get("graph_module")
            if code is not None:
                code.recompile()


def _float_histc(graph: torch.fx.Graph) -> bool:
    """Cast the input of every ``aten.histc`` to float32 (exact for counts below 2**24)."""
    changed = False
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is torch.ops.aten.histc.default:
            with graph.inserting_before(node):
                cast = graph.call_function(torch.ops.aten._to_copy.default, (node.args[0],),
                                           {"dtype": torch.float32})
            node.args = (cast, *node.args[1:])
            changed = True
    return changed


def materialize_stages(modules: list[nn.Module], seed: int, reference: nn.Module, device: str,
                       weights: HFCheckpoint | None = None, constructed=None) -> InitReport:
    """Allocate and initialise this rank's stage modules (laid out, still on meta) from
    ``reference``, the unsplit meta model: each stage gets the slice of the weights one
    process would hold, tied copies on different stages included; from ``weights`` (a
    matched checkpoint) where it has them; ``constructed``: as for
    :func:`autopar.parallel.init.materialize`."""
    reports = [materialize(module, seed, reference=reference, device=device, weights=weights,
                           constructed=constructed)
               for module in modules]
    return InitReport(units=sum(r.units for r in reports),
                      peak_unit_bytes=max(r.peak_unit_bytes for r in reports),
                      local_bytes=sum(r.local_bytes for r in reports))


def replicated_stages(plan: Plan, dp_mesh: DeviceMesh | None) -> bool:
    """Whether this rank's stages are data-parallel replicas (ZeRO-0/1 over several dp ranks):
    their gradients are then all-reduced after the schedule's step
    (:func:`all_reduce_replica_grads`). DDP is not used: its hooks miss the weight gradients of
    the zero-bubble schedule, which computes them apart from the input gradients."""
    if plan.mesh["ep"] > 1:  # dense replicas span dp x ep, even with dp = 1

        return experts_use_ddp(plan)
    return data_parallel_kind(plan, dp_mesh) == "ddp"


def average_replica_grads(modules: list[nn.Module], plan: Plan, dp_group, replica_group,
                          experts: list[nn.Module]) -> None:
    """After the schedule's step of :func:`replicated_stages`: the dense gradients averaged
    over the replicas (dp, or dp x ep under expert parallelism), the experts' summed over dp
    and divided alike (:func:`autopar.parallel.expert_parallel.sync_expert_grads`)."""
    mesh = plan.mesh
    if mesh["ep"] > 1:
        all_reduce_replica_grads(modules, replica_group, mesh["dp"] * mesh["ep"], skip=experts)
        sync_expert_grads(experts, plan, dp_group)
    else:  # dp_group: the dp x cp group under context parallelism (mesh.replica_axis)
        all_reduce_replica_grads(modules, dp_group, mesh["dp"] * mesh.get("cp", 1))


def all_reduce_replica_grads(modules: list[nn.Module], dp_group, dp: int,
                             bucket_bytes: int = 25 * 2**20,
                             skip: list[nn.Module] = ()) -> None:
    """Average the stage gradients over the data-parallel replicas, in buckets of about
    ``bucket_bytes`` (DDP's default bucket size) so that a large stage is a few collectives.
    The parameters of the ``skip`` modules (expert-parallel experts, reduced their own way)
    are left alone."""
    skipped = {id(p) for m in skip for p in m.parameters()}
    grads = [p.grad for m in modules for p in m.parameters()
             if p.grad is not None and id(p) not in skipped]
    bucket: list[torch.Tensor] = []
    size = 0
    for i, g in enumerate(grads):
        bucket.append(g)
        size += g.numel() * g.element_size()
        if size >= bucket_bytes or i == len(grads) - 1:
            flat = torch.cat([t.reshape(-1) for t in bucket])
            dist.all_reduce(flat, group=dp_group)
            flat /= dp
            offset = 0
            for t in bucket:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()
            bucket, size = [], 0


# the ties a model had before :func:`_untie` (tied module paths, alias parameter names): the
# traced stages' tensor-parallel layout is the tied model's (program_steps.prepare_stage)
TIES_ATTR = "_autopar_ties"


def _untie(model: nn.Module) -> None:
    """Give every tied alias (an LM head sharing the embedding's weight) its own Parameter
    (on meta for a meta model) before tracing: otherwise the tracer passes the shared weight from the first
    stage to the last as an activation, which the interleaved schedules refuse (non-adjacent
    stages). The copies are initialised alike (materialize maps aliases to their owner) and
    their gradients summed (:func:`sync_tied_grads`), so training is unchanged. The ties are
    recorded on ``model`` (:data:`TIES_ATTR`)."""
    if not hasattr(model, TIES_ATTR):
        setattr(model, TIES_ATTR, (tied_modules(model), set(tied_copies(model))))
    for alias in tied_copies(model):
        parent, _, attr = alias.rpartition(".")
        module = model.get_submodule(parent) if parent else model
        shared = getattr(module, attr)
        copy = torch.empty_like(shared, device="meta") if shared.is_meta else \
            shared.detach().clone()  # a built model (autopar.parallelize): the same values
        setattr(module, attr, nn.Parameter(copy, requires_grad=shared.requires_grad))


def tied_copies(original: nn.Module) -> dict[str, tuple[str, tuple[int, ...]]]:
    """alias FQN -> (canonical FQN, shape) of tied parameters: the pipeline gives each stage
    its own copy, so their gradients must be summed across stages."""
    first: dict[int, str] = {}
    out = {}
    for name, p in original.named_parameters(remove_duplicate=False):
        if id(p) in first:
            out[name] = (first[id(p)], tuple(p.shape))
        else:
            first[id(p)] = name
    return out


def sync_tied_grads(modules: list[nn.Module], tied: dict, pp_group) -> None:
    """Make every copy's gradient the sum over copies (Megatron's embedding/LM-head all-reduce
    between the first and last stage). Every pp rank joins; holders contribute."""
    for alias, (canonical, shape) in sorted(tied.items()):
        grads = []
        for module in modules:
            params = dict(module.named_parameters())
            for name in (alias, canonical):
                p = params.get(name)
                if p is not None:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                    grads.append(p.grad)
        # fully_shard splits the copies over dp: sum full gradients, then take each shard back
        # fp32 on every rank (the gradients' dtype: parameters are the fp32 masters); ranks
        # holding no copy (middle stages) join the all-reduce with zeros
        like = grads[0] if grads else next(modules[0].parameters())
        total = torch.zeros(shape, dtype=torch.float32, device=like.device)
        for g in grads:
            total += g.full_tensor() if hasattr(g, "full_tensor") else g
        dist.all_reduce(total, group=pp_group)
        for g in grads:
            if hasattr(g, "device_mesh"):
                from torch.distributed.tensor import distribute_tensor

                g.to_local().copy_(distribute_tensor(total, g.device_mesh, g.placements)
                                   .to_local())
            else:
                g.copy_(total)
