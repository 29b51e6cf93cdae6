"""A run next to its plan: what ``autopar run`` logged (``DIR/logs``: the steps, evaluations
and, after ``--profile``, where each stage's step went) against what the plan predicted, term
by term, with the error of each.

The report still reads no model and no cost model: the predictions come from the plan file,
the measurements from the run's logs.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from autopar.errors import PlanError
from autopar.plan import Plan

# measured step terms (autopar.calibrate.trace_summary) -> the plan's term they answer to
TERMS = ("compute", "tp/ep comm (exposed)", "dp comm (exposed)", "bubble", "optimizer",
         "step", "memory")


def _jsonl(path: Path) -> list[dict]:
    """The records of a JSON-lines log. A last line cut short (a run killed mid-write) is
    skipped, and said on stderr; a damaged line before it is refused in one line."""
    if not path.is_file():
        return []
    lines = [(n, line) for n, line in enumerate(path.read_text().splitlines(), 1)
             if line.strip()]
    rows = []
    for i, (number, line) in enumerate(lines):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1 and rows:
                print(f"autopar: {path}:{number}: skipped a line cut short (the run ended "
                      f"mid-write)", file=sys.stderr)
                break
            raise PlanError(f"{path}:{number} is not a JSON line; the log is damaged: "
                            f"delete it and train again") from None
    return rows


def load_run(directory: str | Path) -> dict:
    """What a run of the artifact in ``directory`` logged: {"train": records, "eval":
    records, "profile": the per-stage summary or None}. A directory that has not been run
    is refused in one line."""
    logs = Path(directory) / "logs"
    train = _jsonl(logs / "train.jsonl")
    if not train:
        raise PlanError(f"{directory} has no run to compare: train it first (torchrun ... -m "
                        f"autopar run {directory} --profile), then report --run")
    profile = None
    summary = logs / "profile" / "summary.json"
    if summary.is_file():
        try:
            profile = json.loads(summary.read_text())
        except json.JSONDecodeError:
            raise PlanError(f"{summary} is damaged; run again with --profile") from None
    return {"train": train, "eval": _jsonl(logs / "eval.jsonl"), "profile": profile}


def _measured_terms(terms: dict[str, float]) -> dict[str, float]:
    """A profiled stage's terms folded into the plan's: compute is forward, backward and the
    ops around them; communication by the axis it served; the bubble is what the stage
    spent idle or waiting on its pipeline neighbours."""
    out = dict.fromkeys(TERMS[:5], 0.0)
    for name, seconds in terms.items():
        if name in ("forward", "backward", "other"):
            out["compute"] += seconds
        elif name == "optimizer":
            out["optimizer"] += seconds
        elif name == "idle":
            out["bubble"] += seconds
        elif name.startswith("comm:"):
            axis = name.rsplit(":", 1)[-1]
            key = {"tp": "tp/ep comm (exposed)", "ep": "tp/ep comm (exposed)",
                   "pp": "bubble"}.get(axis, "dp comm (exposed)")
            out[key] += seconds
    return out


def _predicted_terms(plan: Plan, stage: dict) -> dict[str, float]:
    m = plan.num_microbatches
    return {"compute": m * stage.get("compute_s", 0.0),
            "tp/ep comm (exposed)": m * stage.get("comm_s", 0.0),
            "dp comm (exposed)": stage.get("dp_exposed_s", 0.0)
            + m * stage.get("dp_microbatch_s", 0.0),
            "bubble": stage.get("bubble_s", plan.predicted.bubble_s),
            "optimizer": stage.get("optimizer_s", 0.0)}


def _error(predicted: float, measured: float) -> float | None:
    return (predicted - measured) / measured if measured > 0 else None


def _throughput(record: dict) -> float:
    """A step's measured throughput: tokens/s, or a classifier's samples/s (what its plan's
    ``predicted.tokens_per_s`` counts then)."""
    return record["tokens_per_s"] if "tokens_per_s" in record else record["samples_per_s"]


def compare(plan: Plan, run: dict) -> dict:
    """The measured-vs-predicted view: per stage and term, predicted and measured seconds
    (bytes for memory) and the relative error; the run's loss and throughput."""
    train, profile = run["train"], run["profile"]
    window = tuple(profile["window"]) if profile else (0, 0)
    # the profiler slows the steps it records: throughput from the others, after the first
    plain = [r for i, r in enumerate(train) if i > 0 and not window[0] <= i < window[1]] \
        or train
    tokens = statistics.median(_throughput(r) for r in plain)
    step = statistics.median(r["step_time_s"] for r in plain if "step_time_s" in r) \
        if any("step_time_s" in r for r in plain) else None
    mfu = [r["mfu"] for r in plain if r.get("mfu") is not None]
    rows = []
    if profile:
        for s in profile["stages"]:
            index = s["stage"]
            predicted_stage = plan.predicted.stages[index] \
                if index < len(plan.predicted.stages) else {}
            measured = _measured_terms(s["terms_s"])
            predicted = _predicted_terms(plan, predicted_stage)
            for term in TERMS[:5]:
                rows.append(_row(index, term, predicted[term], measured[term]))
            rows.append(_row(index, "step", plan.predicted.step_time_s, s["step_s"]))
            memory = predicted_stage.get("memory", {}).get("total", plan.predicted.memory
                                                           .get("total", 0.0))
            rows.append(_row(index, "memory", memory, s["peak_memory_bytes"]))
    return {
        "steps": len(train), "first_loss": train[0]["loss"], "last_loss": train[-1]["loss"],
        "eval": run["eval"][-1] if run["eval"] else None,
        "tokens_per_s": {"predicted": plan.predicted.tokens_per_s, "measured": tokens},
        "step_time_s": {"predicted": plan.predicted.step_time_s, "measured": step},
        "mfu": {"predicted": plan.predicted.mfu,
                "measured": statistics.median(mfu) if mfu else None},
        "window": list(window) if profile else None,
        "device": profile.get("device") if profile else None,
        "rows": rows,
        "stages": profile["stages"] if profile else [],
        "curves": {"step": [r["step"] for r in train], "loss": [r["loss"] for r in train],
                   "tokens_per_s": [_throughput(r) for r in train],
                   "eval_step": [e["step"] for e in run["eval"]],
                   "eval_loss": [e["loss"] for e in run["eval"]]},
    }


def _row(stage: int, term: str, predicted: float, measured: float) -> dict:
    return {"stage": stage, "term": term, "predicted": predicted, "measured": measured,
            "error": _error(predicted, measured)}
