"""Constraints that pin parts of a plan: a dict, a YAML file, or a shipped preset name.

Keys: pp, dp, tp, ep, microbatch_size, num_microbatches, zero_stage, virtual_stages, recompute
("none" | "selective" | "full", or a list with one of them per block), offload (list of optimizer / params / activations, or "none"; on the command line joined by "+"),
schedule (gpipe | 1f1b | interleaved | zero_bubble), sequence_parallel (bool), precision
(fp32 | bf16 | fp16, or a mapping of param / compute / reduce dtypes and loss_scaling), engine
(autopar | megatron | deepspeed: whose collectives the prediction prices).
A MindFormers ``parallel_config`` block (data_parallel, model_parallel, pipeline_stage,
expert_parallel, micro_batch_num, use_seq_parallel) with ``optimizer_shard`` and
``recompute_config`` is translated to the same keys, and so is a DeepSpeed JSON config
(``zero_optimization``, micro-batch and accumulation, precision, activation checkpointing),
and a file of Megatron-LM arguments (``--tensor-model-parallel-size`` ...).
"""

from __future__ import annotations

from pathlib import Path

import yaml

from autopar._paths import data_dir
from autopar.cost.config import ENGINES, OFFLOADS, SCHEDULES
from autopar.cost.precision import parse_precision
from autopar.errors import PlanError

INT_KEYS = ("pp", "dp", "tp", "ep", "microbatch_size", "num_microbatches", "zero_stage",
            "virtual_stages")
KEYS = (*INT_KEYS, "recompute", "offload", "schedule", "sequence_parallel", "precision",
        "engine")
_IGNORED = ("name", "description")


def preset_names() -> list[str]:
    return sorted(p.stem for p in data_dir("strategies").glob("*.yaml"))


def load_constraints(spec: dict | str | Path | None) -> dict:
    """Validated pins from a dict, a YAML path, a preset name, or ``k=v,k=v`` text."""
    if spec is None:
        return {}
    where = "constraints"
    if isinstance(spec, (str, Path)):
        text = str(spec)
        path = Path(text)
        preset = data_dir("strategies") / f"{text}.yaml"
        if path.is_file() or preset.is_file():
            where = str(path if path.is_file() else preset)
            raw = Path(where).read_text()
            from autopar.plan.megatron import constraints_from_megatron, is_megatron

            try:
                # Megatron-LM arguments (a launch command), recognised by their content
                data = constraints_from_megatron(raw) if is_megatron(raw) else \
                    yaml.safe_load(raw) or {}
            except ValueError as exc:
                raise PlanError(f"{where}: cannot read its Megatron-LM arguments ({exc})") \
                    from None
            except yaml.YAMLError as exc:
                raise PlanError(f"{where} is not valid YAML ({' '.join(str(exc).split())})") \
                    from None
        elif "=" in text:
            data = {}
            for item in text.split(","):
                key, _, value = item.partition("=")
                data[key.strip()] = yaml.safe_load(value.strip())
        else:
            raise PlanError(f"no constraints file or preset '{text}': use a YAML path, k=v pairs "
                            f"(tp=8,pp=2) or a preset: {', '.join(preset_names())}")
    else:
        data = dict(spec)
    if not isinstance(data, dict):
        raise PlanError(f"{where}: expected a mapping of constraint keys")
    from autopar.plan.mindformers import constraints_from_mindformers, is_mindformers

    if is_mindformers(data):
        data = {**{k: v for k, v in data.items() if k in KEYS},
                **constraints_from_mindformers(data)}
    else:
        from autopar.plan.deepspeed import constraints_from_deepspeed, is_deepspeed

        if is_deepspeed(data):  # a DeepSpeed JSON config, recognised by its content
            data = constraints_from_deepspeed(data)
    pins: dict = {}
    for key, value in data.items():
        if key in _IGNORED:
            continue
        if key not in KEYS:
            raise PlanError(f"{where}: unknown constraint '{key}'; use {', '.join(KEYS)}")
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
        if not modes or any(m not in ("none", "selective", "full") for m in modes):
            raise PlanError(f"{where}: recompute must be none, selective or full (or one of "
                            f"them per block), got {value!r}")
        return value if isinstance(value, str) else tuple(value)
    if key == "schedule":
        if value not in SCHEDULES:
            raise PlanError(f"{where}: schedule must be one of {', '.join(SCHEDULES)}, "
                            f"got {value!r}")
        return value
    if key == "sequence_parallel":
        if not isinstance(value, bool):
            raise PlanError(f"{where}: sequence_parallel must be true or false")
        return value
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
