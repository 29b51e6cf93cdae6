"""Constraints that pin parts of a plan: a dict, a YAML file, or a shipped preset name.

Keys: pp, dp, cp, tp, ep, cp_mode (ring | alltoall | hybrid | allgather: how
context-parallel ranks exchange attention's keys and values), stage_layers ([first, last]: layers of the first and
last pipeline stages, the rest split evenly, as Megatron-LM's
--decoder-first/last-pipeline-num-layers), stages (explicit [start, end) block ranges),
microbatch_size, num_microbatches, zero_stage, virtual_stages, recompute
("none" | "selective" | "op" | "full", or a list with one of them per block), offload (list of optimizer / params / activations, or "none"; on the command line joined by "+"),
schedule (gpipe | 1f1b | interleaved | zero_bubble), sequence_parallel (bool), precision
(fp32 | bf16 | fp16, or a mapping of param / compute / reduce dtypes and loss_scaling), engine
(autopar | megatron | megatron-core | deepspeed | llama3-4d | llm-foundry: whose collectives the
prediction prices, how they overlap and what the loss keeps, autopar.cost.engines), vocab_parallel
(bool: false keeps embedding tables whole on every tp rank), model (the shape the pins were
written for: hidden_size, num_layers, num_heads, num_kv_heads, ffn_hidden_size, vocab_size,
seq_length; a model of another shape is refused), capacity_factor (a positive number: GShard
expert capacity, each expert taking at most that many even shares of a sequence's token
copies and dropping the rest; mixture-of-experts training without pipeline stages or context
parallelism; absent or null: dropless).
A MindFormers ``parallel_config`` block (data_parallel, model_parallel, pipeline_stage,
expert_parallel, micro_batch_num, use_seq_parallel) with ``optimizer_shard`` and
``recompute_config`` is translated to the same keys, and so is a DeepSpeed JSON config
(``zero_optimization``, micro-batch and accumulation, precision, activation checkpointing),
and a file of Megatron-LM arguments (``--tensor-model-parallel-size`` ...; with Megatron-Core's
``--tp-comm-overlap`` / ``--overlap-grad-reduce`` / ``--overlap-param-gather`` it pins
engine=megatron-core unless another pin names the engine).
"""

from __future__ import annotations

from pathlib import Path

import yaml

from autopar._paths import data_dir
from autopar.cost.config import CP_MODES, ENGINES, OFFLOADS, SCHEDULES
from autopar.cost.precision import parse_precision
from autopar.cost.recompute_policy import RECOMPUTE_MODES
from autopar.errors import PlanError
from autopar.plan.deepspeed import constraints_from_deepspeed, is_deepspeed
from autopar.plan.megatron import constraints_from_megatron, is_megatron
from autopar.plan.mindformers import constraints_from_mindformers, is_mindformers
from autopar.plan.parallelisms import check_value, registered, registered_names
from autopar.plan.shape import SHAPE_KEYS

INT_KEYS = ("pp", "dp", "cp", "tp", "ep", "microbatch_size", "num_microbatches", "zero_stage",
            "virtual_stages")
KEYS = (*INT_KEYS, "recompute", "offload", "schedule", "sequence_parallel", "precision",
        "engine", "vocab_parallel", "model", "cp_mode", "stage_layers", "stages",
        "capacity_factor")
_IGNORED = ("name", "description")


def preset_names() -> list[str]:
    return sorted(p.stem for p in data_dir("strategies").glob("*.yaml"))


def load_constraints(spec: dict | str | Path | list | tuple | None) -> dict:
    """Validated pins from a dict, a YAML path, a preset name, or ``k=v,k=v`` text; or from
    a list of those, merged in order (a later pin wins): ``[mindformers.yaml,
    "engine=megatron"]``. Another engine's file is translated for the engine the pins name."""
    if spec is None:
        return {}
    specs = list(spec) if isinstance(spec, (list, tuple)) else [spec]
    raws = [_read(s) for s in specs]
    named = None  # what the translations aim at: the engine named, else the runtime's nearest
    for data, kind, _ in raws:
        if kind == "plain" and isinstance(data, dict) and "engine" in data:
            named = data["engine"]
    pins: dict = {}
    for data, kind, where in raws:
        pins.update(_pins(_translate(data, kind, named, where), where))
    return pins


def _read(spec: dict | str | Path) -> tuple[object, str, str]:
    """(the spec's data, its kind: plain / mindformers / deepspeed / megatron, where it came
    from) before any translation."""
    if not isinstance(spec, (str, Path)):
        return dict(spec), "plain", "constraints"
    text = str(spec)
    path = Path(text)
    preset = data_dir("strategies") / f"{text}.yaml"
    if path.is_file() or preset.is_file():
        where = str(path if path.is_file() else preset)
        raw = Path(where).read_text()

        if is_megatron(raw):  # Megatron-LM arguments (a launch command), by their content
            return raw, "megatron", where
        try:
            data = yaml.safe_load(raw) or {}
        except yaml.YAMLError as exc:
            raise PlanError(f"{where} is not valid YAML ({' '.join(str(exc).split())})") \
                from None
    elif "=" in text:
        where = "constraints"
        data = {}
        for item in text.split(","):
            key, _, value = item.partition("=")
            data[key.strip()] = yaml.safe_load(value.strip())
    else:
        raise PlanError(f"no constraints file or preset '{text}': use a YAML path, k=v pairs "
                        f"(tp=8,pp=2) or a preset: {', '.join(preset_names())}")
    if not isinstance(data, dict):
        raise PlanError(f"{where}: expected a mapping of constraint keys")

    kind = "mindformers" if is_mindformers(data) else "deepspeed" if is_deepspeed(data) \
        else "plain"
    return data, kind, where


def _translate(data: object, kind: str, named: str | None, where: str) -> dict:
    """``data`` of another engine's ``kind`` as constraint keys, for the engine ``named`` by
    the other pins (None: a Megatron-LM file's overlap flags choose megatron-core, else the
    runtime's nearest)."""
    engine = named or "autopar"
    if kind == "megatron":
        try:
            return constraints_from_megatron(str(data), named)
        except ValueError as exc:
            raise PlanError(f"{where}: cannot read its Megatron-LM arguments ({exc})") \
                from None
    if kind == "mindformers":
        try:
            translated = constraints_from_mindformers(data, engine)
        except ValueError as exc:
            raise PlanError(f"{where}: {exc}") from None
        # the YAML's own top-level "model" is its model section, read above
        return {**{k: v for k, v in data.items() if k in KEYS and k != "model"}, **translated}
    if kind == "deepspeed":
        return constraints_from_deepspeed(data)
    return data


def _pins(data: dict, where: str) -> dict:
    pins: dict = {}
    for key, value in data.items():
        if key in _IGNORED:
            continue
        if key not in KEYS and registered(key) is not None:  # a registered parallelism
            pins[key] = check_value(key, value, where)
            continue
        if key not in KEYS:
            raise PlanError(f"{where}: unknown constraint '{key}'; use "
                            f"{', '.join([*KEYS, *registered_names()])}")
        pins[key] = _check(key, value, where)
    return pins


def _check(key: str, value: object, where: str) -> object:
    if key in INT_KEYS:
        if not isinstance(value, int) or isinstance(value, bool) or value < (0 if key ==
                                                                              "zero_stage" else 1):
            raise PlanError(f"{where}: {key} must be a positive integer, got {value!r}")
        if key == "zero_stage" and value > 3:
            raise PlanError(f"{where}: zero_stage must be 0, 1, 2 or 3, got {value}")
        return value
    if key == "recompute":
        modes = value if isinstance(value, (list, tuple)) else [value]
        if not modes or any(m not in RECOMPUTE_MODES for m in modes):
            raise PlanError(f"{where}: recompute must be one of {', '.join(RECOMPUTE_MODES)} "
                            f"(or one of them per block), got {value!r}")
        return value if isinstance(value, str) else tuple(value)
    if key == "capacity_factor":
        if value in (None, "none"):
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 \
                or value == float("inf"):
            raise PlanError(f"{where}: capacity_factor must be a positive number (or none: "
                            f"dropless routing), got {value!r}")
        return float(value)
    if key == "cp_mode":
        if value not in CP_MODES:
            raise PlanError(f"{where}: cp_mode must be one of {', '.join(CP_MODES)}, "
                            f"got {value!r}")
        return value
    if key == "stage_layers":
        if not isinstance(value, (list, tuple)) or len(value) != 2 or any(
                not isinstance(v, int) or isinstance(v, bool) or v < 1 for v in value):
            raise PlanError(f"{where}: stage_layers must be [first, last], the layers of the "
                            f"first and last pipeline stages (positive integers), got {value!r}")
        return tuple(value)
    if key == "stages":
        ranges = value if isinstance(value, (list, tuple)) else None
        if not ranges or any(not isinstance(r, (list, tuple)) or len(r) != 2 for r in ranges):
            raise PlanError(f"{where}: stages must be a list of [start, end) block ranges, "
                            f"got {value!r}")
        out = tuple((int(a), int(b)) for a, b in ranges)
        expect = 0
        for start, end in out:
            if start != expect or end <= start:
                raise PlanError(f"{where}: stages {value!r} must be contiguous, non-empty "
                                f"[start, end) ranges from block 0")
            expect = end
        return out
    if key == "schedule":
        if value not in SCHEDULES:
            raise PlanError(f"{where}: schedule must be one of {', '.join(SCHEDULES)}, "
                            f"got {value!r}")
        return value
    if key in ("sequence_parallel", "vocab_parallel"):
        if not isinstance(value, bool):
            raise PlanError(f"{where}: {key} must be true or false")
        return value
    if key == "model":
        if not isinstance(value, dict) or any(
                k not in SHAPE_KEYS or not isinstance(v, int) or isinstance(v, bool) or v < 1
                for k, v in value.items()):
            raise PlanError(f"{where}: model must map {', '.join(SHAPE_KEYS)} to positive "
                            f"integers, got {value!r}")
        return dict(value)
    if key == "precision":
        try:
            return parse_precision(value)
        except (ValueError, KeyError, TypeError) as exc:
            raise PlanError(f"{where}: {exc}") from None
    if key == "engine":
        if value not in ENGINES:
            raise PlanError(f"{where}: engine must be one of {', '.join(ENGINES)}, got {value!r}")
        return value
    # offload
    # a string may join several with "+", as the report prints them ("optimizer+params")
    items = [] if value in (None, "none", False) else (value.split("+") if isinstance(value, str)
                                                       else list(value))
    bad = [i for i in items if i not in OFFLOADS]
    if bad:
        raise PlanError(f"{where}: unknown offload {bad}; use {', '.join(OFFLOADS)} or none")
    return tuple(sorted(items))
