"""Pipeline stages fixed by the pins rather than searched: explicit block ranges, or Megatron-LM's
layer accounting.

Megatron-LM counts transformer layers only: the embedding rides with the first layer's stage
(and chunk) and the output head with the last one's (``megatron/core/transformer/
transformer_block.py`` builds each stage's layers; the embedding and the output layer are
added where ``pre_process`` / ``post_process`` hold, i.e. on the first and last pipeline
stage). Layers split evenly over the stages, unless the first and last stages are given their
own counts (``--decoder-first-pipeline-num-layers`` / ``--decoder-last-pipeline-num-layers``;
the Llama 3 paper, arXiv 2407.21783, Sec. 3.3.2, does the same: one layer fewer on the first
and last stages). autopar's blocks are the layers plus the parts before and after them (the
root/head and the tail blocks of :mod:`autopar.ir.blocks`); here those parts join the first
and last stage.
"""

from __future__ import annotations

from autopar.errors import PlanError
from autopar.ir.graph import Graph


def layer_stages(graph: Graph, pp: int, stage_layers: tuple[int, int] | None = None
                 ) -> tuple[tuple[int, int], ...]:
    """[start, end) block ranges of ``pp`` stages holding the model's layers as Megatron-LM
    splits them: evenly, or ``stage_layers = (first, last)`` layers on the first and last
    stage and the rest evenly over the others; the blocks before the first layer ride with the
    first stage, those after the last layer with the last. PlanError when the layers do not
    split so."""
    n = len(graph.blocks)
    layers = [b.index for b in graph.blocks if b.role == "layer"]
    count = len(layers)
    if pp == 1:
        return ((0, n),)
    if stage_layers is None:
        if count % pp:
            raise PlanError(f"{count} layers do not split evenly over pp={pp} stages; pin "
                            f"stage_layers: [first, last] or another pp")
        per_stage = [count // pp] * pp
    else:
        first, last = stage_layers
        middle = count - first - last
        if pp == 2 and middle != 0 or pp > 2 and (middle < pp - 2 or middle % (pp - 2)):
            raise PlanError(f"stage_layers {[first, last]} leave {middle} of {count} layers "
                            f"for {pp - 2} middle stages: they must split evenly, one layer "
                            f"each at least")
        per_stage = [first] + [middle // (pp - 2)] * (pp - 2) + [last] if pp > 2 \
            else [first, last]
    bounds, at = [], 0
    starts = [0]
    for k in per_stage[:-1]:
        at += k
        starts.append(layers[at])
    starts.append(n)
    for s in range(pp):
        bounds.append((starts[s], starts[s + 1]))
    return tuple(bounds)


def pinned_stages(graph: Graph, pp: int, pins: dict, engine: str
                  ) -> tuple[tuple[int, int], ...] | None:
    """The stages the pins fix for ``pp`` stages, or None when the search chooses them:
    ``stages`` as given; ``stage_layers`` by Megatron-LM's accounting; on engine=megatron,
    Megatron-LM's even split of the layers when they divide (it runs no other)."""
    if "stages" in pins:
        stages = tuple(pins["stages"])
        if len(stages) != pp or stages[-1][1] != len(graph.blocks):
            raise PlanError(f"stages {[list(s) for s in stages]} must be pp={pp} ranges "
                            f"covering the model's {len(graph.blocks)} blocks")
        return stages
    if "stage_layers" in pins:
        return layer_stages(graph, pp, pins["stage_layers"])
    layers = sum(b.role == "layer" for b in graph.blocks)
    if engine == "megatron" and pp > 1 and layers and layers % pp == 0:
        return layer_stages(graph, pp)
    return None


__all__ = ["layer_stages", "pinned_stages"]
