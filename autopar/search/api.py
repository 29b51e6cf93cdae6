"""``autopar.plan``: capture (if needed), search, and package the result as a Plan."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from torch import nn

from autopar.capture import capture
from autopar.cost.config import ENGINES
from autopar.cost.engines import engine_features
from autopar.cost.hardware import Cluster, load_cluster
from autopar.cost.precision import default_precision
from autopar.cost.tp_layout import vocab_parallel
from autopar.errors import PlanError
from autopar.ir.graph import Graph
from autopar.peft import parse_peft
from autopar.plan.plan import Plan, round6
from autopar.plan.shape import model_shape, shape_mismatch
from autopar.search import record
from autopar.search.constraints import load_constraints
from autopar.search.cp_rival import rival_record
from autopar.search.parallelisms import choose_parallelisms, registered_pins
from autopar.search.placements import placements
from autopar.search.planner import SearchResult, search
from autopar.search.serving import max_concurrency, serving_plan_search
from autopar.search.sharding import solve_layouts, staged_restrictions
from autopar.search.space import model_facts
from autopar.search.spec import PlanSpec, Progress, SearchOptions, SearchProblem
from autopar.search.verify_tp import model_and_inputs, tensor_parallel_refusal

TASKS = ("train", "finetune", "infer")


def plan(
    model: nn.Module | str | Path | Graph,
    example_inputs: object = None,
    *,
    devices: int,
    cluster: str | Path | Cluster = "a100-80g",
    task: str = "train",
    global_batch: int | None = None,
    constraints: dict | str | Path | None = None,
    memory_limit_gb: float | None = None,
    time_limit_s: float | None = None,
    progress: Progress | None = None,
    seq: int | None = None,
    peft: object = None,
    max_token_latency_ms: float | None = None,
) -> Plan:
    """Find the fastest plan for ``model`` on ``devices`` devices of ``cluster``.

    ``model`` is anything :func:`autopar.capture` takes, or an already captured Graph.
    ``global_batch`` is sequences per optimizer step (train/finetune) or concurrent sequences
    (infer); it defaults to what the constraints imply (dp x micro-batch x micro-batches), else
    one per device. ``constraints`` pins parts of the plan (a dict, a YAML file, a
    ``strategies/`` preset name, ``"tp=8,pp=2"``, another engine's config, or a list of
    these merged in order). ``seq`` is the tokens per sequence of a named model or config
    (default: the constraints' model seq_length, else the config's context, at most 4096).
    ``peft`` (task="finetune") names a parameter-efficient method, e.g. ``{"method": "lora",
    "r": 8, "lora_alpha": 16, "target_modules": [...]}`` (see :mod:`autopar.peft`): the base
    weights are frozen, and ``plan.trainable_params`` counts what trains.

    ``task="infer"`` plans serving: ``global_batch`` concurrent sequences whose caches hold
    ``seq`` positions; the plan minimises the decoding step (``plan.predicted.
    decode_s_per_token``), and reports the prefill and the KV cache. With
    ``max_token_latency_ms`` it instead maximises tokens per second: the concurrency up to
    ``global_batch`` whose decoding step stays within the bound. Raises
    :class:`autopar.InfeasibleError` when nothing fits, naming the bound and the way out.
    """
    return plan_from_spec(PlanSpec(
        model=model, example_inputs=example_inputs, devices=devices, cluster=cluster,
        task=task, global_batch=global_batch, constraints=constraints,
        memory_limit_gb=memory_limit_gb, time_limit_s=time_limit_s, progress=progress,
        seq=seq, peft=peft, max_token_latency_ms=max_token_latency_ms))


def plan_from_spec(spec: PlanSpec) -> Plan:
    """:func:`plan` for a request already gathered into a :class:`PlanSpec`."""
    model, example_inputs, devices, task = spec.model, spec.example_inputs, spec.devices, \
        spec.task
    global_batch, constraints, memory_limit_gb = spec.global_batch, spec.constraints, \
        spec.memory_limit_gb
    if task not in TASKS:
        raise PlanError(f"task must be one of {', '.join(TASKS)}, got {task!r}")
    if not isinstance(devices, int) or devices < 1:
        raise PlanError(f"devices must be a positive integer, got {devices!r}")
    pins = load_constraints(constraints)
    parallelism_pins = registered_pins(pins)  # chosen after the search, on its plan
    if global_batch is None:
        global_batch = default_global_batch(pins, devices)
    else:
        _check_stated_batch(pins, global_batch)
    if not isinstance(global_batch, int) or global_batch < 1:
        raise PlanError(f"global_batch must be a positive integer, got {global_batch!r}")
    hw = load_cluster(spec.cluster)
    graph = model_graph(model, example_inputs, task, pins, spec.seq, spec.peft)
    capacity = (memory_limit_gb * 1e9 if memory_limit_gb is not None
                else hw.device.usable_memory_bytes)
    if capacity <= 0:
        raise PlanError(f"memory_limit_gb must be positive, got {memory_limit_gb}")
    precision = pins.pop("precision", None) or default_precision(hw.device)
    engine = pins.pop("engine", "autopar")
    if engine not in ENGINES:
        raise PlanError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    defaults = {"precision": precision, "engine": engine,
                "vocab_parallel": pins.pop("vocab_parallel", True),
                "capacity_factor": pins.pop("capacity_factor", None)}
    shape = pins.pop("model", None)
    if shape:  # constraints written for a model (a MindFormers model_config, Megatron flags)
        wrong = shape_mismatch(shape, _shape(graph))
        if wrong:
            raise PlanError(f"the constraints are for another model: they state {wrong}; "
                            f"plan the model they describe, or drop its shape from them")
    facts = model_facts(graph)
    if task == "infer" and pins.get("cp", 1) > 1:
        raise PlanError("context parallelism (cp > 1) is priced for training only; pin cp=1 "
                        "to plan serving")
    if pins.get("cp", 1) > 1 and engine == "autopar" and facts.cp_refusal is not None:
        raise PlanError(f"cp={pins['cp']} does not run on this model ({facts.cp_refusal}); "
                        f"re-plan with constraints cp=1, or engine=megatron to export it")
    _check_pins(pins, facts, devices, global_batch, engine)
    if defaults["capacity_factor"] is not None:
        _capacity_pins(pins, facts, task, engine)
    tps = [t for t in range(2, devices + 1) if devices % t == 0 and facts.tp_ok(t)
           and pins.get("tp", t) == t]
    staged = None
    if engine == "autopar":
        layouts, sharding = solve_layouts(graph, tps, hw, precision.compute,
                                          decode=task == "infer")
        if task != "infer" and staged_restrictions(graph):
            staged, _ = solve_layouts(graph, tps, hw, precision.compute, staged=True)
    else:  # Megatron, DeepSpeed and torchtitan split every block as Megatron does
        layouts, sharding = {}, []
    problem = SearchProblem(graph=graph, facts=facts, cluster=hw, devices=devices, task=task,
                            global_batch=global_batch, pins=pins, capacity=capacity,
                            defaults=defaults, layouts=layouts, staged_layouts=staged)
    if task == "infer":
        result, global_batch = serving_plan_search(problem, spec.max_token_latency_ms,
                                                   spec.progress)
    else:
        if spec.max_token_latency_ms is not None:
            raise PlanError("max_token_latency_ms bounds a serving plan's decoding step: it "
                            "needs task='infer'")
        result = search(problem, SearchOptions(time_limit_s=spec.time_limit_s,
                                               progress=spec.progress))
    plan = build_plan(graph, hw, devices, task, global_batch, result, capacity)
    if task == "infer":
        plan.predicted.max_concurrency = max_concurrency(graph, hw, result.config, capacity)
    if task == "finetune":
        plan.peft = dict(graph.peft)
        plan.trainable_params = facts.trainable_params
    choose_parallelisms(plan, graph, hw, result.config, parallelism_pins, capacity)
    chosen = [sol for sol in sharding if sol.tp == plan.mesh["tp"]]
    plan.solver["sharding"] = {
        f"block type {sol.type_id}": {"status": sol.status, "objective_s": round6(sol.objective_s),
                                      "bound_s": round6(sol.bound_s)} for sol in chosen}
    plan.solver["bounds"] = record.bounds(facts, hw, devices, global_batch, pins, result.config,
                                          result.estimate, capacity, result.rejected,
                                          result.memory_rejected_bounds)
    plan.explain = record.explain(graph, hw, result.config, tps, layouts)
    if result.cp_rival is not None:  # plans with and without cp were weighed: the other side
        plan.solver["context_parallel"] = rival_record(graph, hw, result.config, result.estimate,
                                                       result.cp_rival, task)
    refusal = _tensor_parallel_refusal(model, example_inputs, plan)
    if refusal is not None:  # the layout does not run: the best plan without it
        reason, avoid = refusal
        pinned = {k: pins[k] for k in avoid if k in pins}
        if pinned:
            stated = ", ".join(f"{k}={v}" for k, v in pinned.items())
            raise PlanError(f"{stated} does not run on this model ({reason})")
        plan = plan_from_spec(replace(spec, constraints=[constraints or {}, avoid]))
        plan.solver["tensor_parallel_refused"] = reason
    return plan


def _tensor_parallel_refusal(model: object, example_inputs: object, plan: Plan
                             ) -> tuple[str, dict] | None:
    if plan.mesh["tp"] == 1 or plan.peft:
        return None
    found = model_and_inputs(model, example_inputs)
    return tensor_parallel_refusal(*found, plan) if found is not None else None


def default_global_batch(pins: dict, devices: int) -> int:
    """What :func:`plan` takes when no global batch is given: what the pins imply (another
    engine's config states dp, micro-batch size and micro-batches), else one per device."""
    implied = [pins.get(k) for k in ("dp", "microbatch_size", "num_microbatches")]
    if None in implied:
        return devices
    return implied[0] * pins.get("ep", 1) * implied[1] * implied[2]


def _check_stated_batch(pins: dict, global_batch: int) -> None:
    """A global batch given beside constraints that state another (another engine's config
    pins dp, ep, micro-batch size and micro-batches) is refused naming both: the search
    could only fail on it by divisibility."""
    stated = [pins.get(k) for k in ("dp", "ep", "microbatch_size", "num_microbatches")]
    if None in stated or not isinstance(global_batch, int):
        return  # an unpinned ep or batch axis leaves the search a choice
    dp, ep, micro, count = stated
    if dp * ep * micro * count != global_batch:
        raise PlanError(f"global batch {global_batch} contradicts the {dp * ep * micro * count} "
                        f"the constraints state (dp*ep {dp * ep} x micro-batch size {micro} x "
                        f"{count} micro-batches); give {dp * ep * micro * count} or no global "
                        f"batch, or pin another microbatch_size / num_microbatches")


def model_graph(model: nn.Module | str | Path | Graph, example_inputs: object, task: str,
                pins: dict, seq: int | None = None, peft: object = None) -> Graph:
    """The graph :func:`plan` searches: ``model`` captured as ``plan`` captures it (``seq``
    defaulting to the pins' model seq_length, transformed by ``peft``), or a captured Graph
    checked against ``task`` and ``peft``. Capture once with it to plan many budgets."""
    if task not in TASKS:
        raise PlanError(f"task must be one of {', '.join(TASKS)}, got {task!r}")
    seq = seq or (pins.get("model") or {}).get("seq_length")
    peft_config = None
    if peft is not None:
        if task != "finetune":
            raise PlanError(f"peft= trains part of the model: it needs task='finetune', not "
                            f"{task!r}")
        peft_config = parse_peft(peft)
        if isinstance(model, Graph) and model.peft != peft_config.to_dict():
            raise PlanError("peft= transforms the model before capture; pass the model (or "
                            "its name) rather than a captured graph, or capture it with "
                            "autopar.capture(model, peft=...)")
    if isinstance(model, Graph):
        if model.peft and task != "finetune":
            raise PlanError(f"the graph was captured with a fine-tuning method: plan it with "
                            f"task='finetune', not {task!r}")
        return model

    if isinstance(model, (str, Path)) and example_inputs is None:
        return capture(model, seq=seq, peft=peft_config)
    return capture(model, example_inputs, peft=peft_config)


def _shape(graph: Graph) -> dict[str, int]:
    seq = graph.inputs[0].meta.shape[-1] if graph.inputs and graph.inputs[0].meta.shape else None
    return model_shape(graph.model_config, seq) if graph.model_config else {}


def _capacity_pins(pins: dict, facts, task: str, engine: str) -> None:
    """A capacity factor prices (and the runtime drops) routed token copies: only for a
    training plan of a model with routed experts; for autopar's runtime, on one stage without
    context parallelism (where it counts capacity per whole sequence)."""
    if not facts.experts:
        raise PlanError("capacity_factor caps routed experts, and this model has none; drop "
                        "the constraint")
    if task == "infer":
        raise PlanError("capacity_factor applies to training (generation routes dropless); "
                        "drop it to plan serving")
    for axis in ("pp", "cp") if engine == "autopar" else ():
        if pins.get(axis, 1) > 1:
            raise PlanError(f"capacity_factor with {axis}={pins[axis]}: the runtime counts "
                            f"capacity per whole sequence in one stage; pin {axis}=1 or drop "
                            f"capacity_factor")
        pins[axis] = 1


def _check_pins(pins: dict, facts, devices: int, global_batch: int, engine: str) -> None:
    """A pinned degree that can never work gets its own message, not a generic 'no plan'."""
    product = 1
    for axis in ("pp", "dp", "cp", "ep", "tp"):
        if axis in pins:
            product *= pins[axis]
            if devices % pins[axis]:
                raise PlanError(f"{axis}={pins[axis]} does not divide {devices} devices; pin a "
                                f"divisor of {devices}")
    if devices % product:
        raise PlanError(f"the pinned degrees multiply to {product}, which does not divide "
                        f"{devices} devices")
    if "tp" in pins and not facts.tp_ok(pins["tp"]):
        ok = [t for t in range(1, devices + 1) if devices % t == 0 and facts.tp_ok(t)]
        raise PlanError(f"tp={pins['tp']} does not divide the layers' projection sizes "
                        f"{list(facts.split_dims)}; use tp in {ok}")
    if "ep" in pins and not facts.ep_ok(pins["ep"]):
        raise PlanError(f"ep={pins['ep']} does not divide the model's {facts.experts} experts"
                        if facts.experts else
                        f"ep={pins['ep']} needs a mixture-of-experts model; this one has none")
    cp = pins.get("cp", 1)
    chunks = cp if pins.get("cp_mode") == "alltoall" else 2 * cp  # the ring balances 2 cp
    if cp > 1 and facts.seq % chunks and (pins.get("cp_mode") or facts.seq % cp):
        raise PlanError(f"cp={cp} cannot split {facts.seq}-token sequences into {chunks} equal "
                        f"chunks; pin a cp that does, or a sequence length divisible by "
                        f"{chunks}")
    if pins.get("cp", 1) > 1 and pins.get("cp_mode", "ring") == "alltoall":
        tps = [pins["tp"]] if "tp" in pins else [t for t in range(1, devices + 1)
                                                  if devices % t == 0 and facts.tp_ok(t)]
        reasons = [facts.ulysses_refusal(t, pins["cp"], engine) for t in tps]
        if all(reasons):
            raise PlanError(f"{reasons[0]}; pin cp_mode=ring (or hybrid), or a cp that divides "
                            f"the heads")
    if "pp" in pins and pins["pp"] > facts.blocks:
        raise PlanError(f"pp={pins['pp']} exceeds the model's {facts.blocks} blocks")
    modes = pins.get("recompute")
    if isinstance(modes, tuple) and len(modes) != facts.blocks:
        raise PlanError(f"recompute lists {len(modes)} modes for the model's {facts.blocks} "
                        f"blocks; give one mode per block or a single mode")


def build_plan(graph: Graph, cluster: Cluster, devices: int, task: str, global_batch: int,
               result: SearchResult, capacity: float) -> Plan:
    config, est = result.config, result.estimate
    recompute = [config.recompute_of(i) for i in range(len(graph.blocks))]
    model = {
        "source": graph.source,
        "params": graph.num_params,
        "inputs": {i.name: list(i.meta.shape) for i in graph.inputs},
        # the runtime reads the training task from these (token ids or images: see
        # autopar.train.task)
        "input_dtypes": {i.name: i.meta.dtype for i in graph.inputs},
        # the runtime sizes its loss from this (a plain nn.Module has no config to ask)
        "outputs": {o: list(graph.op(o).output_meta[0].shape) for o in graph.outputs
                    if graph.has_op(o) and graph.op(o).output_meta},
        "blocks": [{"name": b.name, "type": b.type_id, "kind": b.kind} for b in graph.blocks],
    }
    if graph.model_config.get("model_type"):
        model["model_type"] = graph.model_config["model_type"]
    shape = _shape(graph)
    if shape:  # what other engines' files state: Megatron's shape flags, MindFormers' model
        model["shape"] = shape
    tied_split = engine_features(config.engine).tied_vocab_parallel
    model["vocab_parallel"] = any(vocab_parallel(graph, op.name, config.tp,
                                                 config.vocab_parallel, tied_split)
                                  for op in graph.ops)
    solver = {
        "method": "per-block-type tensor-parallel sharding by CP-SAT; mesh, batching, ZeRO, "
                  "schedule and offload by exhaustive search with lower-bound pruning; "
                  "contiguous stage partitions by dynamic programming over Pareto fronts; "
                  "per-stage recompute by exact enumeration; among plans within 3% of the "
                  "fastest, the least sensitive to slower communication and halved overlap",
        "bound_s": round6(result.bound_s), "gap": round6(result.gap),
        "evaluated": result.evaluated, "pruned_by_bound": result.pruned_by_bound,
        "rejected": dict(sorted(result.rejected.items())), "timed_out": result.timed_out,
        "robust": {k: (round6(v) if isinstance(v, float) else v)
                   for k, v in result.robust.items() if k != "checks"},
    }
    precision = config.precision
    return Plan(
        model=model, devices=devices, cluster=cluster.name, task=task, global_batch=global_batch,
        mesh={"pp": config.pp, "dp": config.dp, "cp": config.cp, "ep": config.ep,
              "tp": config.tp},
        microbatch_size=config.microbatch_size, num_microbatches=config.num_microbatches,
        zero_stage=config.zero_stage, schedule=config.schedule,
        virtual_stages=config.virtual_stages, sequence_parallel=config.sequence_parallel,
        recompute=recompute, offload=sorted(config.offload),
        stages=[list(s) for s in (config.stages or ())],
        placements=placements(graph, config),
        predicted=record.predicted(graph, cluster, config, est, task,
                                   result.robust.get("checks")),
        alternatives=[record.runner_up(graph, cluster, c, e, est, task)
                      for c, e in result.alternatives],
        solver=solver, memory_limit_bytes=round6(capacity),
        precision=precision.as_dict() if precision is not None else {},
        engine=config.engine, cp_mode=config.cp_mode, capacity_factor=config.capacity_factor,
    )
