"""The planner's own full-size tensor-parallel layouts, run on tiny twins.

The layout the planner chooses at tp=8 for the full-size model (captured on meta) is copied
onto a tiny model of the same architecture, planned at tp=2, by parameter pattern (layer index
folded). Nothing is written by hand: what runs is what the planner picked at full size. The
test counts the weights really split, and the twin must equal one process (fp32, gloo).
"""

from __future__ import annotations

import re

import pytest

import autopar
from autopar.runtime.source import describe_source

from .harness import run_ranks

pytestmark = pytest.mark.dist
STEPS = 4
TWINS = [("llama3-8b", "tiny-llama")]  # the fused-projection models join when those split


def _logits_layout(trainer) -> str:
    """How the LM head leaves the logits: split over the vocabulary, or whole."""
    import torch

    out = trainer.model(torch.zeros(1, 8, dtype=torch.long))
    logits = out.logits if hasattr(out, "logits") else out
    return str(logits.placements[0]) if hasattr(logits, "placements") else "whole"


def _pattern(fqn: str) -> str:
    return re.sub(r"\.\d+\.", ".*.", fqn)


def _full_size_layout(name: str) -> dict[str, str]:
    graph = autopar.capture(name, seq=4096)
    plan = autopar.plan(graph, devices=8, global_batch=8,
                        constraints=dict(tp=8, pp=1, sequence_parallel=False))
    return {_pattern(k): v for k, v in plan.placements["params"].items()}


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2-sp"])
@pytest.mark.parametrize("full,tiny", TWINS, ids=[t[1] for t in TWINS])
def test_full_size_layout_runs_on_its_tiny_twin(full: str, tiny: str,
                                                sequence_parallel: bool) -> None:
    layout = _full_size_layout(full)
    graph = autopar.capture(tiny, seq=32)
    source = describe_source(tiny)
    plan = autopar.plan(graph, devices=2, global_batch=4,
                        constraints=dict(tp=2, dp=1, pp=1, microbatch_size=2,
                                         sequence_parallel=sequence_parallel))
    params = plan.placements["params"]
    for fqn in params:
        params[fqn] = layout[_pattern(fqn)]
    split = sum(1 for v in params.values() if v.startswith("Shard"))
    assert split >= 7 * len(graph.layer_blocks) + 1  # q, k, v, o, gate, up, down + head
    reference, _ = run_ranks(source, autopar.plan(graph, devices=1, global_batch=4,
                                                  constraints=dict(microbatch_size=2)), STEPS)
    losses, sharded, logits = run_ranks(source, plan, STEPS, probe=_logits_layout)
    assert sharded == split  # every weight the layout splits is a sharded DTensor
    assert logits == "S(2)"  # split over the vocabulary, as the cost model prices
    assert losses == pytest.approx(reference, rel=1e-4)
