"""What a search is asked, as records instead of long parameter lists.

:class:`PlanSpec` is what :func:`autopar.plan` was given (its public keywords, one record);
:class:`SearchProblem` is what the search itself solves once those are resolved (the captured
graph, the cluster, the pins, the memory capacity); :class:`SearchOptions` how it searches
(time limit, progress, runner-ups kept).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

    from autopar.cost.config import TPLayouts
    from autopar.cost.hardware import Cluster
    from autopar.ir.graph import Graph
    from autopar.search.space import ModelFacts

# progress(fraction done, what) while searching
Progress = Callable[[float, str], None]


@dataclass(frozen=True)
class PlanSpec:
    """The request :func:`autopar.plan` turns into a Plan: the model, the cluster and the
    budget (its keyword arguments, documented there)."""

    model: nn.Module | str | Path | Graph
    devices: int
    example_inputs: object = None
    cluster: str | Path | Cluster = "a100-80g"
    task: str = "train"
    global_batch: int | None = None
    constraints: dict | str | Path | list | None = None
    memory_limit_gb: float | None = None
    time_limit_s: float | None = None
    progress: Progress | None = None
    seq: int | None = None
    peft: object = None
    max_token_latency_ms: float | None = None


@dataclass(frozen=True)
class SearchProblem:
    """A resolved planning problem: what every candidate is priced against.

    ``pins`` fixes any of pp, dp, tp, ep, microbatch_size, num_microbatches, zero_stage,
    recompute, offload, schedule, sequence_parallel; ``defaults`` sets the remaining
    ParallelConfig fields (precision, engine, vocab_parallel); ``layouts`` are the per-op
    tensor-parallel layouts per degree (:func:`autopar.search.sharding.solve_layouts`), and
    ``staged_layouts`` those of candidates with pipeline stages where these differ;
    ``capacity`` is the bytes one device may hold.
    """

    graph: Graph
    facts: ModelFacts
    cluster: Cluster
    devices: int
    task: str
    global_batch: int
    pins: dict
    capacity: float
    defaults: dict = field(default_factory=dict)
    layouts: dict[int, TPLayouts] | None = None
    # the layouts of candidates with pipeline stages, where they differ (None: ``layouts``)
    staged_layouts: dict[int, TPLayouts] | None = None


@dataclass(frozen=True)
class SearchOptions:
    """How to search: stop after ``time_limit_s`` (with the best found so far), report
    ``progress``, keep ``keep`` runner-ups."""

    time_limit_s: float | None = None
    progress: Progress | None = None
    keep: int = 5
