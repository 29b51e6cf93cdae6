"""The registry of parallelisms applied on top of the mesh the search chose.

A parallelism of this kind changes how each rank runs what the plan already gives it (keep a
layer's parameters gathered, a communication hook, a prefetch depth), not which ranks hold
what. It is three pieces, and adding one touches nothing else:

- its **cost and capability**, a module in ``cost/``: ``supported(config)`` (why a
  configuration cannot use it, or None) and ``price(graph, config, cluster, value)``: the
  seconds one value adds to the step (negative: saves) and the bytes it adds to the most
  loaded device, against the step the estimate priced without it;
- its **runtime**, a module in ``parallel/`` with ``apply(model, mesh, plan, value)``, called by
  the generated program after the model's data-parallel wrapping (``parallelize`` and, under
  pipelines, ``parallelize_stage``);
- **one entry** in :data:`PARALLELISMS` below (and the import of its cost module): the
  :class:`Parallelism` record that ties them.

The search prices every value of every registered parallelism on the plan it found and keeps
the fastest that fits memory (the first value, the one a plan without it runs, on a tie); a
constraint with the parallelism's name pins a value. The plan records the values it chose
(``plan.parallelisms``), its predictions include their price, and the generated program
imports the runtime module and calls ``apply`` with the value (through ``repr``). A new mesh
axis is not this kind: it changes what the search enumerates (see docs/architecture.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from autopar.errors import PlanError

if TYPE_CHECKING:
    from autopar.cost.config import ParallelConfig
    from autopar.cost.hardware import Cluster
    from autopar.ir.graph import Graph

Value = bool | int | str


@dataclass(frozen=True)
class Parallelism:
    """One registered parallelism. ``name`` is its constraint key and its key in
    ``plan.parallelisms`` (an identifier); ``values`` what a plan may hold, the first being
    what a plan without it runs; ``runtime`` the module (``autopar.parallel.NAME``) whose
    ``apply(model, mesh, plan, value)`` the generated program calls; ``supported`` and ``price``
    its cost module's functions; ``what`` one line for the program's comment; ``term`` the
    breakdown term (``plan.predicted.breakdown``) and ``memory_kind`` the memory kind its price
    changes."""

    name: str
    values: tuple[Value, ...]
    runtime: str
    supported: Callable[[ParallelConfig], str | None]
    # (seconds added to the step, bytes added to the most loaded device)
    price: Callable[[Graph, ParallelConfig, Cluster, Value], tuple[float, float]]
    what: str
    term: str = "dp_comm_s"
    memory_kind: str = "params"

    def __post_init__(self) -> None:
        if not self.name.isidentifier() or not all(p.isidentifier()
                                                   for p in self.runtime.split(".")):
            raise ValueError(f"parallelism {self.name!r}: name and runtime must be Python "
                             f"identifiers (a dotted module path for runtime)")
        if len(self.values) < 2 or any(type(v) not in (bool, int, str) for v in self.values):
            raise ValueError(f"parallelism {self.name!r}: give at least two values, each a "
                             f"bool, int or str")


# the registry: one entry per parallelism (docs/architecture.md: "Adding a parallelism")
PARALLELISMS: list[Parallelism] = [
]


def registered(name: str) -> Parallelism | None:
    """The registered parallelism called ``name``, or None."""
    return next((p for p in PARALLELISMS if p.name == name), None)


def registered_names() -> list[str]:
    return [p.name for p in PARALLELISMS]


def all_registered() -> list[Parallelism]:
    """Every registered parallelism, in registry order."""
    return list(PARALLELISMS)


def check_value(name: str, value: object, where: str) -> Value:
    """``value`` for the registered parallelism ``name``, or a one-line PlanError naming the
    values it takes."""
    p = registered(name)
    if p is None:
        known = ", ".join(registered_names()) or "none are registered"
        raise PlanError(f"{where}: {name!r} is not a registered parallelism ({known}); remove "
                        f"it, or re-plan")
    if type(value) not in (bool, int, str) or value not in p.values or \
            type(value) is not type(next(v for v in p.values if v == value)):
        raise PlanError(f"{where}: {name} must be one of "
                        f"{', '.join(repr(v) for v in p.values)}, got {value!r}")
    return value  # type: ignore[return-value]
