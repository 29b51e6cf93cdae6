"""Candidates in lower-bound order, with groups of them expanded only when reached.

A group is the candidates one base configuration (mesh, cp mode, micro-batching, sequence
parallelism) spans over its knobs (ZeRO stage, schedule, offload). Its lower bound holds for
every member (:func:`autopar.search.bounds.pipelined_work_lower_bound`), so a group whose bound
is beyond the search's cutoff is pruned whole, without pricing any member's bound: what keeps
the search quick once context parallelism multiplies the meshes.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Generic, TypeVar

from autopar.cost.config import ParallelConfig

C = TypeVar("C")


@dataclass(order=True)
class CandidateGroup:
    """A base configuration and a lower bound on any candidate it expands to."""

    lower_bound_s: float
    tie: tuple
    base: ParallelConfig = field(compare=False)
    payload: object = field(compare=False, default=None)  # what the expansion needs


class BestFirst(Generic[C]):
    """Yields candidates (ordered dataclasses with ``lower_bound_s``) in ascending bound;
    ``expand`` turns a group into its candidates, each bound raised to the group's (both are
    lower bounds on the same plans)."""

    def __init__(self, groups: list[CandidateGroup],
                 expand: Callable[[CandidateGroup], list[C]]) -> None:
        self._groups = sorted(groups)
        self._next = 0  # the first group not expanded yet
        self._heap: list = []
        self._expand = expand

    def __iter__(self) -> Iterator[C]:
        while True:
            while self._next < len(self._groups) and (
                    not self._heap
                    or self._groups[self._next].lower_bound_s <= self._heap[0].lower_bound_s):
                group = self._groups[self._next]
                self._next += 1
                for cand in self._expand(group):
                    if cand.lower_bound_s < group.lower_bound_s:
                        cand = replace(cand, lower_bound_s=group.lower_bound_s)
                    heapq.heappush(self._heap, cand)
            if not self._heap:
                return
            yield heapq.heappop(self._heap)

    def progress(self) -> float:
        """The share of groups expanded so far."""
        return self._next / max(len(self._groups), 1)

    def rest(self) -> list[tuple[ParallelConfig, float]]:
        """What was not yielded: (configuration, lower bound) per candidate left and (base
        configuration, group bound) per group never expanded."""
        out = [(c.config, c.lower_bound_s) for c in self._heap]
        out += [(g.base, g.lower_bound_s) for g in self._groups[self._next:]]
        return out


__all__ = ["BestFirst", "CandidateGroup"]
