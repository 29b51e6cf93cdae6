"""Where a run's numbers go: JSON lines (``logs/train.jsonl``, ``logs/eval.jsonl``), a console
line per step, and TensorBoard event files when ``tensorboard`` is installed.

Only rank 0 writes. The console line comes from ``rich``: a live line on a terminal, one
plain line per step in a log file or a pipe (``torchrun ... > run.log`` reads as a log).
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

from autopar.report import fmt


def step_line(record: dict, total: int, eta_s: float | None) -> str:
    """The console line of one step: step/total, loss, learning rate, tokens/s (a
    classifier's samples/s), a mixture of experts' router loss and expert load (the busiest
    and idlest expert against an even share), MFU, memory, ETA."""
    speed = f"{fmt.count(record['tokens_per_s'])} tok/s" if "tokens_per_s" in record else \
        f"{fmt.count(record['samples_per_s'])} samples/s"
    parts = [f"step {record['step'] + 1}/{total}", f"loss {record['loss']:.4f}",
             f"lr {record['lr']:.3g}", speed]
    if "router_aux_loss" in record:  # a mixture of experts' balance: its loss, busiest/idlest
        parts.append(f"aux {record['router_aux_loss']:.4f} load "
                     f"{record['expert_load_min']:.2f}-{record['expert_load_max']:.2f}x")
    if "expert_dropped_share" in record:  # copies past the experts' capacity
        parts.append(f"dropped {fmt.pct(record['expert_dropped_share'])}")
    if record.get("mfu") is not None:
        parts.append(f"MFU {fmt.pct(record['mfu'])}")
    parts.append(f"mem {fmt.nbytes(record['peak_memory_bytes'])}")
    parts.append(f"ETA {_clock(eta_s)}" if eta_s is not None else "ETA -")
    return "  ".join(parts)


def eval_line(record: dict) -> str:
    return (f"eval after step {record['step']}: loss {record['loss']:.4f}  perplexity "
            f"{record['perplexity']:.2f}  ({fmt.count(record['tokens'])} tokens)")


def _clock(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}"


class RunLog:
    """A run's sinks. ``directory`` holds ``train.jsonl`` and ``eval.jsonl`` (None: no files);
    ``console`` prints the step line; ``tensorboard`` writes event files under
    ``directory/tensorboard`` when the package is importable (``tensorboard_dir`` says where,
    or None)."""

    def __init__(self, directory: str | Path | None, *, console: bool = False,
                 tensorboard: bool = False, every: int = 1, resume: bool = False) -> None:
        self.directory = Path(directory) if directory is not None else None
        # one log per run: records carry the run's id; a resumed run goes on with its log's
        self.run_id = (_last_run_id(self.directory) if resume and self.directory else None) \
            or time.strftime("%Y%m%d-%H%M%S", time.gmtime())
        self.every = max(1, every)
        self._console = None
        self._bar = None
        self._total = 0
        self._first = 0  # steps done before this run (a resumed one)
        self._times: list[float] = []
        if console:
            from rich.console import Console

            self._console = Console(highlight=False, soft_wrap=True)
        self.tensorboard_dir: Path | None = None
        self._writer = None
        self._tensorboard = tensorboard and self.directory is not None

    def start(self, total_steps: int, first_step: int = 0) -> None:
        """A run of ``total_steps`` steps begins after ``first_step`` steps done before (a
        resumed run's: the console's step/total counts from the first run). Nothing is
        written before: a run refused earlier leaves no logs."""
        self._total = total_steps
        self._first = first_step
        self._times = []
        if self._tensorboard and self._writer is None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # tensorboard is optional
                SummaryWriter = None
            if SummaryWriter is not None:
                self.tensorboard_dir = self.directory / "tensorboard"
                self._writer = SummaryWriter(str(self.tensorboard_dir))
        if self._console is not None and self._console.is_terminal:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
            )

            self._bar = Progress(TextColumn("step"), MofNCompleteColumn(), BarColumn(),
                                 TextColumn("{task.fields[stats]}"), TextColumn("ETA"),
                                 TimeRemainingColumn(), console=self._console)
            self._task = self._bar.add_task("train", total=total_steps, stats="")
            self._bar.start()

    def step(self, record: dict, done: int) -> None:
        """One training step's record (step, loss, lr, step_time_s, tokens_per_s or a
        classifier's samples_per_s, mfu, peak_memory_bytes); ``done``: steps of this run
        finished so far."""
        self._append("train.jsonl", record)
        self._times.append(record["step_time_s"])
        if self._writer is not None:
            for key in ("loss", "lr", "tokens_per_s", "samples_per_s", "mfu",
                        "peak_memory_bytes", "router_aux_loss", "router_z_loss",
                        "expert_load_max", "expert_load_min", "expert_dropped_share"):
                value = record.get(key)
                if value is not None and math.isfinite(value):
                    self._writer.add_scalar(f"train/{key}", value, record["step"])
        if self._bar is not None:
            stats = step_line(record, self._first + self._total, None).split(
                "  ", 1)[1].rsplit("  ETA", 1)[0]
            self._bar.update(self._task, completed=done, stats=stats)
        elif self._console is not None and (done % self.every == 0 or done == self._total):
            self._console.print(step_line(record, self._first + self._total, self._eta(done)),
                                markup=False)

    def evaluation(self, record: dict) -> None:
        """One evaluation's record (step, loss, perplexity, tokens)."""
        self._append("eval.jsonl", record)
        if self._writer is not None:
            self._writer.add_scalar("eval/loss", record["loss"], record["step"])
            self._writer.add_scalar("eval/perplexity", record["perplexity"], record["step"])
        if self._console is not None:
            self._console.print(eval_line(record), markup=False)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def _eta(self, done: int) -> float | None:
        # the first step pays one-off costs (allocation, warm-up): leave it out when we can
        times = self._times[1:] or self._times
        if not times:
            return None
        return (self._total - done) * sum(times) / len(times)

    def _append(self, name: str, record: dict) -> None:
        if self.directory is None:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        with (self.directory / name).open("a") as f:
            f.write(json.dumps({**record, "run": self.run_id}) + "\n")


_RUN_FILES = ("train.jsonl", "eval.jsonl", "tensorboard", "profile")


def _last_run_id(directory: Path) -> str | None:
    """The run id of the last whole record in ``directory``/train.jsonl, or None."""
    try:
        lines = (directory / "train.jsonl").read_text().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            run = json.loads(line).get("run")
        except (ValueError, AttributeError):
            continue
        return str(run) if run else None
    return None


def archive_logs(directory: Path) -> Path | None:
    """Move an earlier run's logs out of the way of a new run: ``directory``/runs/<its run
    id>/ (nothing is deleted); returns where they went, or None when there were none."""
    present = [directory / name for name in _RUN_FILES if (directory / name).exists()]
    if not present:
        return None
    run = _last_run_id(directory) or "earlier"
    target = directory / "runs" / run
    n = 2
    while target.exists():
        target, n = directory / "runs" / f"{run}.{n}", n + 1
    target.mkdir(parents=True)
    for path in present:
        os.replace(path, target / path.name)
    return target
