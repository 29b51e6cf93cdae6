"""``autopar.sweep``: the best plan for each of several device budgets, from one capture, and
where the plan's shape changes from one budget to the next. Pure data: rendering is in
:mod:`autopar.report.sweep`."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from torch import nn

from autopar.errors import InfeasibleError, PlanError
from autopar.ir.graph import Graph
from autopar.plan import Plan
from autopar.plan.schedule import schedule_label
from autopar.search.api import default_global_batch, model_graph, plan
from autopar.search.constraints import load_constraints

# What makes a plan's shape: dp is left out (it is devices / (pp x tp x ep), so it grows with
# every budget), and so is the number of micro-batches (the replica's batch divided by the
# micro-batch size); naming them would mark every row as a change.
SHAPE_FIELDS = ("pp", "tp", "ep", "cp", "cp_mode", "zero_stage", "schedule", "microbatch_size",
                "recompute", "offload", "sequence_parallel")


@dataclass
class SweepRow:
    """One device budget: its plan (exactly what ``autopar.plan`` returns for that budget
    alone), or why there is none."""

    devices: int
    global_batch: int
    plan: Plan | None = None
    reason: str | None = None  # the InfeasibleError's (or refused pin's) line when no plan
    # the shape fields that differ from the previous feasible row: {"field", "before", "after"}
    changes: list[dict] = field(default_factory=list)
    note: str | None = None  # what the global batch does to this budget, when it matters
    seq: int | None = None  # tokens per sequence, in a sweep over sequence lengths

    @property
    def feasible(self) -> bool:
        return self.plan is not None

    def shape(self) -> dict[str, object]:
        """The plan's shape fields (:data:`SHAPE_FIELDS`); recompute per block, so that a
        mode moving between blocks counts too. Empty without a plan."""
        p = self.plan
        if p is None:
            return {}
        cp = p.mesh.get("cp", 1)
        return {"pp": p.mesh["pp"], "tp": p.mesh["tp"], "ep": p.mesh["ep"], "cp": cp,
                "cp_mode": p.cp_mode if cp > 1 else "-",
                "zero_stage": p.zero_stage, "schedule": schedule_label(p),
                "microbatch_size": p.microbatch_size, "recompute": tuple(p.recompute),
                "offload": sorted(p.offload), "sequence_parallel": p.sequence_parallel}

    def to_dict(self) -> dict:
        """The row as plain data (what ``autopar sweep --format json`` prints)."""
        row: dict = {"devices": self.devices, "global_batch": self.global_batch,
                     "feasible": self.feasible}
        if self.seq is not None:
            row["seq"] = self.seq
        p = self.plan
        if p is None:
            row["reason"] = self.reason
        else:
            pred = p.predicted
            row.update({
                "mesh": dict(p.mesh), "cp_mode": p.cp_mode, "zero_stage": p.zero_stage, "schedule": p.schedule,
                "virtual_stages": p.virtual_stages, "microbatch_size": p.microbatch_size,
                "num_microbatches": p.num_microbatches, "recompute": p.recompute_counts(),
                "offload": list(p.offload), "sequence_parallel": p.sequence_parallel,
                "predicted": {"step_time_s": pred.step_time_s,
                              "tokens_per_s": pred.tokens_per_s,
                              "tokens_per_s_per_device": pred.tokens_per_s / self.devices,
                              "mfu": pred.mfu, "memory_bytes": pred.memory["total"],
                              "memory_limit_bytes": p.memory_limit_bytes},
            })
        row["changes"] = [dict(c) for c in self.changes]
        row["note"] = self.note
        return row


def shape_changes(before: SweepRow, after: SweepRow) -> list[dict]:
    """The shape fields that differ from ``before`` to ``after``, in :data:`SHAPE_FIELDS`
    order: ``[{"field": "tp", "before": 1, "after": 2}]`` (recompute as blocks per mode);
    empty when the shape is the same or either row has no plan."""
    a, b = before.shape(), after.shape()
    if not a or not b:
        return []
    out = []
    for k in SHAPE_FIELDS:
        if a[k] != b[k]:
            if k == "recompute":
                out.append({"field": k, "before": before.plan.recompute_counts(),
                            "after": after.plan.recompute_counts()})
            else:
                out.append({"field": k, "before": a[k], "after": b[k]})
    return out


def _note(devices: int, global_batch: int, task: str) -> str | None:
    if global_batch % devices == 0:
        return None
    # autopar.plan keeps only meshes whose data-parallel degree (dp x ep) divides the batch
    what = "the concurrency" if task == "infer" else "the global batch"
    return (f"{what} ({global_batch}) is not a multiple of the budget: dp x ep must divide "
            f"{global_batch}")


def sweep(model: nn.Module | str | Path | Graph, devices: Iterable[int],
          example_inputs: object = None, *,
          on_budget: Callable[[int, int, int], None] | None = None,
          **plan_kwargs: object) -> list[SweepRow]:
    """Plan ``model`` for each device count in ``devices`` (ascending, duplicates dropped),
    capturing it once; ``plan_kwargs`` are :func:`autopar.plan`'s (cluster, task,
    global_batch, constraints, seq, peft, memory_limit_gb, ...), the same for every budget.

    Each row holds exactly the Plan ``autopar.plan`` returns for that budget alone, or, where
    none fits (or a pinned degree does not divide the budget), the error's one line. Each
    feasible row's ``changes`` name the shape fields that differ from the previous feasible
    row. ``on_budget(devices, i, n)`` is called before planning each budget (for progress).
    Raises the PlanError that every budget raises alike (an input no budget can fix).
    """
    given = list(devices)
    if not given or any(not isinstance(d, int) or d < 1 for d in given):
        raise PlanError(f"devices must be positive integers, got {given!r}")
    budgets = sorted(set(given))
    pins = load_constraints(plan_kwargs.get("constraints"))
    task = str(plan_kwargs.get("task", "train"))
    graph = model_graph(model, example_inputs, task, pins, plan_kwargs.get("seq"),
                        plan_kwargs.get("peft"))
    rows: list[SweepRow] = []
    refused: list[PlanError] = []
    previous: SweepRow | None = None
    for i, n in enumerate(budgets):
        if on_budget is not None:
            on_budget(n, i, len(budgets))
        batch = plan_kwargs.get("global_batch") or default_global_batch(pins, n)
        try:
            result = plan(graph, devices=n, **plan_kwargs)
        except (InfeasibleError, PlanError) as exc:  # PlanError: a pin that misses this budget
            if isinstance(exc, PlanError):
                refused.append(exc)
            rows.append(SweepRow(n, batch, reason=str(exc), note=_note(n, batch, task)))
            continue
        row = SweepRow(n, result.global_batch, plan=result,
                       note=_note(n, result.global_batch, task))
        if previous is not None:
            row.changes = shape_changes(previous, row)
        rows.append(row)
        previous = row
    if len(refused) == len(rows) and len({str(e) for e in refused}) == 1:
        raise refused[0]  # the same refusal at every budget is the input's, not a budget's
    return rows


def sweep_seq(model: nn.Module | str | Path, seqs: Iterable[int], *, devices: int,
              on_seq: Callable[[int, int, int], None] | None = None,
              capture: Callable[[int], Graph] | None = None,
              **plan_kwargs: object) -> list[SweepRow]:
    """Plan ``model`` (a name or config :func:`autopar.plan` captures) on ``devices`` devices
    for each sequence length in ``seqs`` (ascending, duplicates dropped), capturing it once
    per length (the captured shapes are the sequence's); ``plan_kwargs`` as :func:`sweep`'s.
    Rows and ``changes`` as :func:`sweep`'s, each with its ``seq``; where the plan's mesh,
    context parallelism (cp, cp_mode), recompute or other shape field changes from the
    previous length, ``changes`` names it. ``on_seq(seq, i, n)`` is called before each;
    ``capture(seq)``, when given, captures the model at a length (the CLI's capture)."""
    given = list(seqs)
    if not given or any(not isinstance(s, int) or s < 1 for s in given):
        raise PlanError(f"sequence lengths must be positive integers, got {given!r}")
    if isinstance(model, Graph):
        raise PlanError("a captured graph has one sequence length; pass the model (its name "
                        "or config) to sweep sequence lengths")
    if "seq" in plan_kwargs:
        raise PlanError("sweep_seq takes its sequence lengths as seqs, not seq=")
    pins = load_constraints(plan_kwargs.get("constraints"))
    task = str(plan_kwargs.get("task", "train"))
    ordered = sorted(set(given))
    rows: list[SweepRow] = []
    previous: SweepRow | None = None
    for i, seq in enumerate(ordered):
        if on_seq is not None:
            on_seq(seq, i, len(ordered))
        graph = capture(seq) if capture is not None else model_graph(
            model, None, task, pins, seq, plan_kwargs.get("peft"))
        batch = plan_kwargs.get("global_batch") or default_global_batch(pins, devices)
        try:  # the graph carries the fine-tuning method
            result = plan(graph, devices=devices,
                          **{k: v for k, v in plan_kwargs.items() if k != "peft"})
        except (InfeasibleError, PlanError) as exc:
            rows.append(SweepRow(devices, batch, reason=str(exc), seq=seq))
            continue
        row = SweepRow(devices, result.global_batch, plan=result, seq=seq,
                       note=_note(devices, result.global_batch, task))
        if previous is not None:
            row.changes = shape_changes(previous, row)
        rows.append(row)
        previous = row
    return rows


def tokens_range(first: int, last: int) -> list[int]:
    """``first``, twice that, ... up to ``last`` (sequence lengths: ``8192..1048576`` is the
    eight powers of two from 8k to 1M)."""
    if first < 1 or last < first:
        raise PlanError(f"a sequence-length range runs from a positive length up: got "
                        f"{first}..{last}")
    return devices_range(first, last)


def devices_range(first: int, last: int) -> list[int]:
    """``first``, twice that, ... up to ``last``: ``devices_range(8, 1024)`` is the eight
    powers of two from 8 to 1024."""
    if first < 1 or last < first:
        raise PlanError(f"a device range runs from a positive count up: got {first}..{last}")
    out = [first]
    while out[-1] * 2 <= last:
        out.append(out[-1] * 2)
    return out
