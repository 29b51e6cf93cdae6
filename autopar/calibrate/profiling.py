"""``autopar run --profile``: torch.profiler over a window of steps, a Chrome trace per rank
(``DIR/logs/profile/rank{R}.trace.json``, opens in Perfetto or chrome://tracing), each rank's
summary beside it and, on rank 0, ``summary.json``: per pipeline stage, where the step went
(:mod:`autopar.calibrate.trace_summary`) and its peak memory.

Peak memory is what tensors held: on an accelerator the allocator's peak over the window; on
the CPU the bytes the model, its gradients and the optimizer held when the window opened plus
the most the profiler saw allocated on top during it.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import torch
import torch.distributed as dist

from autopar.calibrate.trace_summary import read_trace, summarize_trace
from autopar.report import fmt

SUMMARY = "summary.json"


def trace_path(directory: Path, rank: int) -> Path:
    return directory / f"rank{rank}.trace.json"


class StepProfiler:
    """Profile steps ``window = (start, end)`` of a run (0-based, of this run's steps).

    Call :meth:`step` after every training step; :meth:`finish` writes the summaries (every
    rank calls it: rank 0 gathers the others')."""

    def __init__(self, directory: str | Path, rank: int, window: tuple[int, int],
                 device: torch.device, mesh: dict[str, int] | None = None) -> None:
        self.directory, self.rank, self.window = Path(directory), rank, window
        self.mesh = mesh  # the plan's degrees: which axis a collective serves
        self.device = device
        self.directory.mkdir(parents=True, exist_ok=True)
        start, end = window
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        # one warm-up step before the window when there is one: the profiler's own start-up
        # stays out of the recorded steps
        warmup = 1 if start > 0 else 0
        schedule = torch.profiler.schedule(skip_first=start - warmup, wait=0, warmup=warmup,
                                           active=end - start, repeat=1)
        self._profiler = torch.profiler.profile(
            activities=activities, schedule=schedule, record_shapes=True, profile_memory=True,
            on_trace_ready=self._write)
        self._done = 0
        self._held_bytes = 0.0
        self._written: Path | None = None
        self._running = False

    def start(self, trainer) -> None:
        self._trainer = trainer
        self.first_step = trainer.step_index  # the run's first step (a resumed run's later)
        self._profiler.start()
        self._running = True
        if self.window[0] == 0:
            self._open_window()

    def step(self) -> None:
        """One training step finished."""
        self._done += 1
        if self._done == self.window[0]:
            self._open_window()
        if self._done <= self.window[1]:
            self._profiler.step()

    def _open_window(self) -> None:
        self._held_bytes = _state_bytes(self._trainer)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def _write(self, profiler) -> None:
        path = trace_path(self.directory, self.rank)
        profiler.export_chrome_trace(str(path))
        self._written = path

    def close(self) -> None:
        """Stop the profiler if it runs (a run that failed mid-window): its collection must
        not outlive the run, which ends by tearing down the process group. Safe to repeat."""
        if self._running:
            self._running = False
            self._profiler.stop()

    def finish(self, coords: dict[str, int]) -> dict | None:
        """Stop, summarise this rank's trace, gather every rank's on rank 0 and write
        ``summary.json`` there; returns it on rank 0 (None elsewhere)."""
        self.close()
        mine: dict = {"rank": self.rank, "coords": coords}
        if self._written is not None:
            trace = read_trace(self._written)
            mine.update(summarize_trace(trace, self.mesh))
            if self.device.type == "cuda":
                mine["peak_memory_bytes"] = float(torch.cuda.max_memory_allocated(self.device))
            else:
                mine["peak_memory_bytes"] = self._held_bytes + _profiled_peak(trace)
            (self.directory / f"rank{self.rank}.summary.json").write_text(json.dumps(mine))
        everyone = [mine]
        if dist.is_initialized() and dist.get_world_size() > 1:
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, mine)
        if self.rank != 0:
            return None
        summary = stage_summary(everyone, self.window)
        summary.update(first_step=self.first_step, device=self.device.type, mesh=self.mesh)
        (self.directory / SUMMARY).write_text(json.dumps(summary, indent=1))
        return summary


def stage_summary(ranks: list[dict], window: tuple[int, int]) -> dict:
    """Every rank's summary folded per pipeline stage: the median step, the mean of each term
    over the stage's ranks, the largest peak memory."""
    stages: dict[int, list[dict]] = {}
    for r in ranks:
        if "terms_s" in r:
            stages.setdefault(r["coords"].get("pp", 0), []).append(r)
    out = []
    for index in sorted(stages):
        members = stages[index]
        terms = sorted({k for m in members for k in m["terms_s"]})
        out.append({
            "stage": index, "ranks": [m["rank"] for m in members],
            "step_s": statistics.median(m["step_s"] for m in members),
            "terms_s": {k: statistics.fmean(m["terms_s"].get(k, 0.0) for m in members)
                        for k in terms},
            "peak_memory_bytes": max(m["peak_memory_bytes"] for m in members),
        })
    step = max((s["step_s"] for s in out), default=0.0)
    return {"window": list(window), "step_s": step, "stages": out,
            "first_step": 0, "device": "cpu", "mesh": None,
            "traces": [f"rank{r['rank']}.trace.json" for r in ranks]}


def _state_bytes(trainer) -> float:
    """Bytes this rank's model, gradients and optimizer states hold now."""
    seen: set[int] = set()
    total = 0.0

    def add(t) -> None:
        nonlocal total
        if isinstance(t, torch.Tensor):
            local = t.to_local() if hasattr(t, "to_local") else t
            if id(local) not in seen:
                seen.add(id(local))
                total += local.numel() * local.element_size()

    for p in trainer.model.parameters():
        add(p)
        add(p.grad)
    for b in trainer.model.buffers():
        add(b)
    optimizer = getattr(trainer.optimizer, "optim", trainer.optimizer)  # ZeRO-1: its shard
    for state in optimizer.state.values():
        for value in state.values():
            add(value)
    return total


def _profiled_peak(trace: dict) -> float:
    """The most bytes the profiler saw allocated at once (CPU memory events)."""
    peak = 0.0
    for e in trace.get("traceEvents", []):
        if e.get("name") == "[memory]":
            peak = max(peak, float(e.get("args", {}).get("Total Allocated", 0)))
    return peak


def summary_text(summary: dict) -> str:
    """A few lines of the per-stage summary for the console."""
    lines = [f"profiled steps {summary['window'][0]}..{summary['window'][1] - 1}: step "
             f"{fmt.seconds(summary['step_s'])}"]
    for s in summary["stages"]:
        terms = ", ".join(f"{k.removeprefix('comm:')} {fmt.seconds(v)}"
                          for k, v in sorted(s["terms_s"].items(), key=lambda kv: -kv[1])
                          if v > 0)
        lines.append(f"  stage {s['stage']}: {terms}; peak memory "
                     f"{fmt.nbytes(s['peak_memory_bytes'])}")
    return "\n".join(lines)
