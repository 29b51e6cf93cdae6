"""Tensor-parallel layouts the planner chose, at full size, for tiny models' tests.

On a tiny model the planner rightly keeps most weights replicated (an all-reduce costs more
than the split saves), so "tp2 equals one process" would test little. The tests therefore take
the layout the planner chooses for the same architecture at full size (captured on meta,
planned at tp=8) and copy it onto the tiny model's plan by parameter pattern (layer index
folded). Nothing is written by hand: what runs is what the planner picked.
"""

from __future__ import annotations

import functools
import re

import autopar

# the tiny models' full-size siblings: a shipped config, or a GPTConfig for autopar's own GPT
FULL_SIZE = {"gpt": dict(vocab_size=50304, seq_len=2048, d_model=4096, n_layers=2, n_heads=32),
             "tiny-llama": "llama3-8b", "tiny-mixtral": "mixtral-8x7b",
             "tiny-phi3": "phi3-mini", "tiny-gpt-neox": "gpt-neox-20b",
             "tiny-gpt2": "gpt3-175b", "tiny-qwen2-moe": "qwen2-57b-a14b"}


def pattern(fqn: str) -> str:
    return re.sub(r"\.\d+\.", ".*.", fqn)


@functools.cache
def full_size_layout(tiny: str, tp: int = 8, seq: int = 1024, peft: str | None = None
                     ) -> dict[str, str]:
    """Parameter pattern -> placement the planner chooses for ``tiny``'s full-size sibling
    (fine-tuned with ``peft``, as k=v text, when given: its adapters' placements too)."""
    full = FULL_SIZE[tiny]
    if isinstance(full, dict):
        import torch

        from autopar.models import GPT, GPTConfig, token_inputs

        with torch.device("meta"):
            model = GPT(GPTConfig(**full))
        graph = autopar.capture(model, token_inputs(1, full["seq_len"]))
    else:
        graph = autopar.capture(full, seq=seq, peft=peft)
    plan = autopar.plan(graph, devices=tp, global_batch=tp, memory_limit_gb=1e6,  # the layout
                        constraints=dict(tp=tp, pp=1, sequence_parallel=False),
                        task="finetune" if peft else "train")
    return {pattern(k): v for k, v in plan.placements["params"].items()}


def with_full_size_layout(plan, tiny: str, tp: int = 8, peft: str | None = None):
    """``plan`` (of ``tiny``, tp > 1) with the tensor-parallel placements of the full-size
    sibling's plan; its other placements (ZeRO-3's @dp, experts' @ep) stay."""
    layout = full_size_layout(tiny, tp, peft=peft)
    params = plan.placements["params"]
    for fqn, placement in params.items():
        mine = [p for p in placement.split("+") if "@tp" not in p and p != "Replicate"]
        theirs = [p for p in layout[pattern(fqn)].split("+") if "@tp" in p]
        params[fqn] = "+".join(theirs + mine) or "Replicate"
    return plan


def split_weights(plan) -> set[str]:
    """The weights a plan splits over tp."""
    return {k for k, v in plan.placements["params"].items()
            if "@tp" in v and k.endswith("weight")}
