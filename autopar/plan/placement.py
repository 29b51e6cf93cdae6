"""A parameter's placement as a record: which dimensions it is split along, over which mesh
axes.

The plan file writes placements in a small grammar (checked by :mod:`autopar.plan.schema`):
``Replicate``; ``Shard(d)@tp`` (dimension d split over the tensor-parallel ranks; ``@ep`` over
the expert-parallel ranks, ``@dp`` ZeRO-3's data-parallel sharding, ``@cp``);
``Shard(0)@tp+Shard(0)@dp`` (both, in that order); ``Replicate@tp(kv-heads)`` (whole on every
tensor-parallel rank, each rank using its query heads' key/value heads). The string is the
file's form only: readers parse it here once and ask the record.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from autopar.errors import PlanError

REPLICATE = "Replicate"
KV_HEADS = "Replicate@tp(kv-heads)"
_SHARD = re.compile(r"^Shard\((\d+)\)@(tp|dp|ep|cp)$")


@dataclass(frozen=True)
class Shard:
    """One split: tensor dimension ``dim`` over mesh axis ``axis``."""

    dim: int
    axis: str  # tp, dp, ep, cp

    def __str__(self) -> str:
        return f"Shard({self.dim})@{self.axis}"


@dataclass(frozen=True)
class Placement:
    """Where one parameter lives: its splits in order (none: replicated), or replicated over
    tp with key/value heads chosen per rank (``kv_heads``)."""

    shards: tuple[Shard, ...] = ()
    kv_heads: bool = False

    @classmethod
    def parse(cls, text: str) -> Placement:
        """The record of a placement string; one that does not follow the grammar is a
        PlanError naming it."""
        if text == REPLICATE:
            return cls()
        if text == KV_HEADS:
            return cls(kv_heads=True)
        shards = []
        for part in str(text).split("+"):
            match = _SHARD.match(part)
            if match is None:
                raise PlanError(f"placement {text!r} is not Replicate, Replicate@tp(kv-heads) "
                                f"or Shard(d)@axis joined by '+'; fix it or re-plan")
            shards.append(Shard(int(match.group(1)), match.group(2)))
        return cls(tuple(shards))

    def __str__(self) -> str:
        if self.kv_heads:
            return KV_HEADS
        return "+".join(map(str, self.shards)) or REPLICATE

    def dim_over(self, axis: str) -> int | None:
        """The dimension split over ``axis``, or None where the parameter is whole along it."""
        return next((s.dim for s in self.shards if s.axis == axis), None)

    @property
    def tp_dim(self) -> int | None:
        """The dimension split over the tensor-parallel ranks (None: whole there)."""
        return self.dim_over("tp")

    @property
    def splits_over_tp(self) -> bool:
        """Whether tensor parallelism cuts this parameter's work: a tp split, or kv-head
        replication (whole, but each rank's output is its own heads')."""
        return self.kv_heads or self.tp_dim is not None


def parse_placements(params: dict[str, str]) -> dict[str, Placement]:
    """The records of a plan's ``placements.params`` (parameter FQN -> placement string)."""
    return {fqn: Placement.parse(text) for fqn, text in params.items()}


def shard_dims(placements: dict[str, str], layer: str) -> dict[str, int]:
    """The tensor-parallel shard dimension of each parameter of ``layer`` (relative names)
    from a plan's parameter placements (``Shard(d)@tp...``)."""
    out = {}
    for fqn, text in placements.items():
        if not fqn.startswith(layer + "."):
            continue
        placement = Placement.parse(text)
        if placement.kv_heads:
            raise PlanError(f"the plan places {fqn} as {text}, which a layer run from "
                            f"its graph cannot hold (only Shard(d)@tp); re-plan with tp=1")
        if placement.tp_dim is not None:
            out[fqn[len(layer) + 1:]] = placement.tp_dim
    return dict(sorted(out.items()))
