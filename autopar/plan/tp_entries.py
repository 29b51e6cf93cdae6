"""A plan's ``placements.fused`` and ``placements.heads`` entries, checked before any work.

The planner records them under tensor parallelism (autopar.search.placements): ``fused`` maps a
projection cut end to end into parts (q, k, v; gate, up) to the parts' widths, ``heads`` maps an
attention module to [query heads, key/value heads, head size]. The runtime splits each part
and gives each rank its local head counts from them, so an entry a hand edit broke would
otherwise surface as an IndexError on every rank. Here: what the plan alone can show wrong
(at load); :func:`check_against_model` in autopar.train.parallelize checks them against the model.
"""

from __future__ import annotations

from autopar.errors import PlanError
from autopar.plan.placement import Placement

FIX = "restore the entry or re-plan with autopar compile"


def _positive_ints(value: object) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)


def module_params(params: dict, path: str) -> dict[str, str]:
    """The placements of the parameters ``path`` holds itself (not its children's)."""
    return {fqn: where for fqn, where in params.items() if fqn.rpartition(".")[0] == path}


def _split_over_tp(placement: str) -> bool:
    """Whether a placement splits its parameter over tp (kv-head replication keeps it
    whole but cuts its output per rank, so it counts too)."""
    return Placement.parse(placement).splits_over_tp


def validate_tp_entries(placements: dict, tp: int, where: str = "plan") -> None:
    """Refuse, in one line, a ``fused`` or ``heads`` entry the plan itself shows is wrong:
    not positive integers, heads whose query heads are not whole groups of key/value heads, a
    fused module whose weight the plan does not place, and (for the modules the plan splits
    over tp > 1) parts or heads that tp does not split whole."""
    params = placements.get("params") or {}
    fused = placements.get("fused") or {}
    heads = placements.get("heads") or {}
    for key, entries in (("fused", fused), ("heads", heads)):
        if not isinstance(entries, dict):
            raise PlanError(f"{where}: placements.{key} must map module paths to lists of "
                            f"integers, got {type(entries).__name__}; {FIX}")
    for path, parts in fused.items():
        if not _positive_ints(parts):
            raise PlanError(f"{where}: placements.fused[{path}] is {parts!r}, not a list of "
                            f"positive part widths; {FIX}")
        # an einsum projection's entry names its weight itself
        own = {path: params[path]} if path in params else module_params(params, path)
        if not own:
            raise PlanError(f"{where}: placements.fused names {path}, whose weight "
                            f"placements.params does not place; {FIX}")
        if tp > 1 and any(_split_over_tp(w) for w in own.values()):
            odd = next((p for p in parts if p % tp), None)
            if odd is not None:
                raise PlanError(f"{where}: placements.fused[{path}] {parts} has a part of "
                                f"{odd} that tp={tp} does not split whole; {FIX}")
    for path, entry in heads.items():
        if not _positive_ints(entry) or len(entry) != 3:
            raise PlanError(f"{where}: placements.heads[{path}] is {entry!r}, not [query heads, "
                            f"key/value heads, head size] as positive integers; {FIX}")
        q, kv, _ = entry
        if q % kv:
            raise PlanError(f"{where}: placements.heads[{path}] {entry} has {q} query heads, "
                            f"not a multiple of its {kv} key/value heads; {FIX}")
        split = any(_split_over_tp(w) for fqn, w in params.items()
                    if fqn.startswith(path + "."))
        if tp > 1 and split and (q % tp or (kv % tp and tp % kv)):
            raise PlanError(f"{where}: placements.heads[{path}] {entry} cannot be split whole "
                            f"over tp={tp} (query heads must divide by tp, key/value heads "
                            f"divide by tp or tp by them); {FIX}")
