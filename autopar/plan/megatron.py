"""A plan as a Megatron-LM launch command, and Megatron-LM arguments as constraints.

Megatron-LM's arguments carry the model-parallel side of a plan: tensor, pipeline (and
virtual pipeline), context (``--context-parallel-size``, ``--cp-comm-type``) and expert sizes,
the layers of uneven first and last stages, sequence parallelism, the micro-batch and global batch,
recompute, and its distributed optimizer (ZeRO-1: optimizer states sharded over dp). The
data-parallel size is the world size over tp x pp x cp (x ep for the experts' replicas), so the
emitted command states the world size through torchrun's ``--nnodes`` and ``--nproc-per-node``.
"""

from __future__ import annotations

import shlex

from autopar.cost.engines import megatron_chunks_divide
from autopar.plan.plan import Plan
from autopar.plan.support import refuse_op_recompute

# Megatron-Core's overlap options (megatron/training/arguments.py): TP communication beside
# its GEMMs (TransformerEngine userbuffers), gradient reduction beside the backward, the
# distributed optimizer's parameter gather beside the forward: the megatron-core engine
OVERLAP_FLAGS = ("--tp-comm-overlap", "--overlap-grad-reduce", "--overlap-param-gather")
_FLAGS = {"--sequence-parallel", "--use-distributed-optimizer", "--bf16", "--fp16",
          "--group-query-attention", "--use-megatron-fsdp", *OVERLAP_FLAGS}
# Megatron-Core's own FSDP (--use-megatron-fsdp): what --data-parallel-sharding-strategy shards
# (megatron/training/arguments.py): gradients too (ZeRO-2), parameters too (ZeRO-3)
_FSDP_STRATEGY = {2: "optim_grads", 3: "optim_grads_params"}
# the model's shape: plan.shape's words -> Megatron-LM's flags
_SHAPE = (("num_layers", "--num-layers"), ("hidden_size", "--hidden-size"),
          ("ffn_hidden_size", "--ffn-hidden-size"), ("num_heads", "--num-attention-heads"),
          ("seq_length", "--seq-length"))
# Megatron-Core's --cp-comm-type (TransformerEngine's context-parallel attention) per cp_mode
_CP_COMM = {"ring": "p2p", "alltoall": "a2a", "hybrid": "a2a+p2p", "allgather": "all_gather"}


def megatron_args(plan: Plan) -> list[str]:
    """Megatron-LM's ``pretrain_gpt.py`` arguments for ``plan``."""
    refuse_op_recompute(plan, "Megatron-LM")
    m = plan.mesh
    layers = len(plan.layers)
    args = ["--tensor-model-parallel-size", str(m["tp"]),
            "--pipeline-model-parallel-size", str(m["pp"]),
            "--micro-batch-size", str(plan.microbatch_size),
            "--global-batch-size", str(plan.global_batch)]
    if m["ep"] > 1:
        args += ["--expert-model-parallel-size", str(m["ep"])]
    if plan.capacity_factor is not None:  # token dropping in sequence order, like autopar's
        args += ["--moe-expert-capacity-factor", repr(float(plan.capacity_factor)),
                 "--moe-token-drop-policy", "position"]
    if m.get("cp", 1) > 1:
        args += ["--context-parallel-size", str(m["cp"]),
                 "--cp-comm-type", _CP_COMM[plan.cp_mode]]
    chunks = m["pp"] * plan.virtual_stages
    if plan.schedule == "interleaved" and plan.virtual_stages > 1 and layers % chunks == 0:
        args += ["--num-layers-per-virtual-pipeline-stage", str(max(1, layers // chunks))]
    elif plan.schedule == "interleaved" and plan.virtual_stages > 1 and \
            megatron_chunks_divide(plan.engine or "megatron", layers, chunks):
        # the embedding and the loss each count as a layer (Megatron-Core)
        args += ["--num-virtual-stages-per-pipeline-rank", str(plan.virtual_stages),
                 "--account-for-embedding-in-pipeline-split",
                 "--account-for-loss-in-pipeline-split"]
    per_stage = [sum(1 for b in plan.model.blocks[start:end] if b.is_layer)
                 for start, end in plan.stages]
    if m["pp"] > 2 and len(set(per_stage[1:-1])) == 1 and (
            per_stage[0] != per_stage[1] or per_stage[-1] != per_stage[1]):
        # uneven first and last stages (the middle ones even): Megatron-Core's own flags
        args += ["--decoder-first-pipeline-num-layers", str(per_stage[0]),
                 "--decoder-last-pipeline-num-layers", str(per_stage[-1])]
    if plan.sequence_parallel and m["tp"] > 1:
        args.append("--sequence-parallel")
    modes = {mode for b, mode in zip(plan.model.blocks, plan.recompute, strict=True)
             if b.is_layer}
    if modes == {"full"}:
        args += ["--recompute-granularity", "full", "--recompute-method", "uniform",
                 "--recompute-num-layers", "1"]
    elif "selective" in modes:
        args += ["--recompute-granularity", "selective"]
    elif "full" in modes:  # some layers: Megatron's block method recomputes the first N
        per_stage = max(1, sum(1 for mode in plan.recompute if mode == "full") // m["pp"])
        args += ["--recompute-granularity", "full", "--recompute-method", "block",
                 "--recompute-num-layers", str(per_stage)]
    if plan.zero_stage >= 1:
        args.append("--use-distributed-optimizer")
    if plan.engine == "megatron-core" and plan.zero_stage >= 2:  # Megatron FSDP
        args += ["--use-megatron-fsdp", "--data-parallel-sharding-strategy",
                 _FSDP_STRATEGY[plan.zero_stage]]
    if plan.engine == "megatron-core":  # the overlap its prediction assumed
        if plan.sequence_parallel and m["tp"] > 1:
            args.append("--tp-comm-overlap")  # userbuffers need sequence parallelism
        args.append("--overlap-grad-reduce")
        if plan.zero_stage >= 1:
            args.append("--overlap-param-gather")  # the distributed optimizer's gather
    compute = plan.training_precision.compute
    if compute in ("bf16", "fp16"):
        args.append(f"--{compute}")
    shape = {"num_layers": layers, "seq_length": plan.seq, **(plan.model.shape or {})}
    for key, flag in _SHAPE:
        if key in shape:
            args += [flag, str(shape[key])]
    if shape.get("num_kv_heads", shape.get("num_heads")) != shape.get("num_heads"):
        args += ["--group-query-attention", "--num-query-groups", str(shape["num_kv_heads"])]
    if "seq_length" in shape:
        args += ["--max-position-embeddings", str(shape["seq_length"])]
    return args


def megatron_command(plan: Plan, gpus_per_node: int = 8) -> str:
    """A launch command (torchrun + pretrain_gpt.py) with ``plan``'s arguments."""
    nproc = min(gpus_per_node, plan.devices)
    nnodes = max(1, plan.devices // nproc)
    notes = []
    if plan.zero_stage >= 2 and plan.engine != "megatron-core":
        notes.append(f"ZeRO-{plan.zero_stage} in the plan: Megatron's distributed optimizer "
                     f"shards optimizer states only")
    layer_modes = {mode for b, mode in zip(plan.model.blocks, plan.recompute, strict=True)
                   if b.is_layer}
    if "selective" in layer_modes and len(layer_modes) > 1:
        notes.append("the plan recomputes some layers selectively: Megatron-LM's selective "
                     "granularity covers every layer")
    if plan.schedule in ("zero_bubble", "gpipe") or (
            plan.schedule == "interleaved" and not {
                "--num-layers-per-virtual-pipeline-stage",
                "--num-virtual-stages-per-pipeline-rank"} & set(megatron_args(plan))):
        notes.append(f"the plan's {plan.schedule} schedule has no Megatron-LM argument here: "
                     f"1F1B runs")
    lines = [f"# Megatron-LM launch for an autopar plan ({plan.devices} devices)"]
    lines += [f"# {n}" for n in notes]
    lines.append(f"torchrun --nnodes {nnodes} --nproc-per-node {nproc} pretrain_gpt.py \\")
    args = megatron_args(plan)
    pairs, i = [], 0
    while i < len(args):
        if args[i] in _FLAGS:
            pairs.append(args[i])
            i += 1
        else:
            pairs.append(f"{args[i]} {args[i + 1]}")
            i += 2
    lines += [f"    {p} \\" for p in pairs[:-1]] + [f"    {pairs[-1]}"]
    return "\n".join(lines) + "\n"


def is_megatron(text: str) -> bool:
    """Whether a constraints file holds Megatron-LM arguments (by its content)."""
    return "--tensor-model-parallel-size" in text or "--pipeline-model-parallel-size" in text


def constraints_from_megatron(text: str, engine: str | None = "autopar") -> dict:
    """Constraint keys pinned by Megatron-LM arguments (a launch command or a list), for a
    plan priced for ``engine``. ``engine=None`` (no engine named elsewhere): Megatron-Core's
    overlap flags pin the megatron-core engine, whose prediction prices that overlap;
    without them the plan is for autopar's runtime."""
    words = shlex.split(text, comments=True)
    values: dict[str, str | bool] = {}
    for i, word in enumerate(words):
        if not word.startswith("--"):
            continue
        key, _, inline = word.partition("=")
        if key in _FLAGS:
            values[key] = True
        elif inline:
            values[key] = inline
        elif i + 1 < len(words) and not words[i + 1].startswith("--"):
            values[key] = words[i + 1]
    if engine is None:
        core = any(values.get(f) for f in (*OVERLAP_FLAGS, "--use-megatron-fsdp"))
        engine = "megatron-core" if core else "autopar"
    out: dict = {"tp": int(values.get("--tensor-model-parallel-size", 1)),
                 "pp": int(values.get("--pipeline-model-parallel-size", 1)),
                 "ep": int(values.get("--expert-model-parallel-size", 1)),
                 "sequence_parallel": bool(values.get("--sequence-parallel", False))}
    if "--moe-expert-capacity-factor" in values:
        out["capacity_factor"] = float(values["--moe-expert-capacity-factor"])
    cp = int(values.get("--context-parallel-size", 1))
    if cp > 1 or "--context-parallel-size" in values:
        out["cp"] = cp
    comm = str(values.get("--cp-comm-type", "p2p"))
    modes = {v: k for k, v in _CP_COMM.items()}
    if cp > 1:
        if comm not in modes:
            raise ValueError(f"--cp-comm-type {comm} is not one of {', '.join(modes)}")
        out["cp_mode"] = modes[comm]
    first = values.get("--decoder-first-pipeline-num-layers")
    last = values.get("--decoder-last-pipeline-num-layers")
    if (first or last) and out["pp"] > 1:
        layers = int(values.get("--num-layers", 0))
        others = out["pp"] - (first is not None) - (last is not None)
        rest = layers - int(first or 0) - int(last or 0)
        if (first is None or last is None) and (not layers or others < 1 or rest % others):
            raise ValueError("--decoder-first/last-pipeline-num-layers leave layers that do "
                             "not split evenly over the other stages (state --num-layers)")
        even = rest // others if others else 0
        out["stage_layers"] = [int(first) if first else even, int(last) if last else even]
    if "--micro-batch-size" in values:
        out["microbatch_size"] = int(values["--micro-batch-size"])
    world = int(values.get("--nnodes", 1)) * int(values.get("--nproc-per-node", 0))
    if world and "--global-batch-size" in values and "--micro-batch-size" in values:
        dp_ep = world // (out["tp"] * out["pp"] * cp)
        out["dp"] = dp_ep // out["ep"]
        out["num_microbatches"] = int(values["--global-batch-size"]) // (
            out["microbatch_size"] * dp_ep)
    if "--num-layers-per-virtual-pipeline-stage" in values and "--num-layers" in values:
        out["schedule"] = "interleaved"
        out["virtual_stages"] = int(values["--num-layers"]) // (
            out["pp"] * int(values["--num-layers-per-virtual-pipeline-stage"]))
    elif "--num-virtual-stages-per-pipeline-rank" in values:
        out["schedule"] = "interleaved"
        out["virtual_stages"] = int(values["--num-virtual-stages-per-pipeline-rank"])
    elif out["pp"] > 1:
        out["schedule"] = "1f1b"  # Megatron's pipeline schedule without virtual stages
    granularity = values.get("--recompute-granularity")
    if granularity in ("full", "selective") and values.get("--recompute-method") != "block":
        out["recompute"] = granularity
    elif granularity is None:
        out["recompute"] = "none"
    # the distributed optimizer shards optimizer states (ZeRO-1); under tp autopar's own
    # runtime runs that as ZeRO-2 (the nearest stage it supports; see plan/support.py);
    # without it, under tp, the stage is left to the search for the same reason
    keep = out["tp"] == 1 or engine != "autopar"
    strategy = {v: k for k, v in _FSDP_STRATEGY.items()}.get(
        str(values.get("--data-parallel-sharding-strategy", "")))
    if values.get("--use-megatron-fsdp") and strategy:
        out["zero_stage"] = strategy
    elif values.get("--use-distributed-optimizer"):
        out["zero_stage"] = 1 if keep else 2
    elif keep:
        out["zero_stage"] = 0
    shape = {key: int(values[flag]) for key, flag in _SHAPE if flag in values}
    if "--num-query-groups" in values and values.get("--group-query-attention"):
        shape["num_kv_heads"] = int(values["--num-query-groups"])
    elif "num_heads" in shape:
        shape["num_kv_heads"] = shape["num_heads"]
    if shape:
        out["model"] = shape
    out["precision"] = "bf16" if values.get("--bf16") else "fp16" if values.get("--fp16") \
        else "fp32"
    if engine == "megatron-core":
        out["engine"] = engine
    return out
