"""Recompute as planned: ``selective`` means what the cost model means (the attention core is
recomputed, nothing else), whatever the attention module is called; ``full`` recomputes the
layer. Checked by counting the ops the backward re-runs, on plans drawn from the search."""

from __future__ import annotations

import copy
import math
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import autopar

SEQ, D = 16, 32


class Mixer(nn.Module):
    """Single-head causal attention under a name that is not "attn"; fused or by hand."""

    def __init__(self, fused: bool) -> None:
        super().__init__()
        self.qkv, self.out, self.fused = nn.Linear(D, 3 * D), nn.Linear(D, D), fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        if self.fused:
            return self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True))
        scores = q @ k.transpose(-1, -2) / math.sqrt(D)
        mask = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1)
        return self.out(scores.masked_fill(mask, float("-inf")).softmax(-1) @ v)


class Layer(nn.Module):
    def __init__(self, fused: bool) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.mixer = Mixer(fused)
        self.up, self.down = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mixer(self.norm1(x))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class LM(nn.Module):
    def __init__(self, fused: bool, vocab: int = 64, layers: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, D)
        self.layers = nn.ModuleList([Layer(fused) for _ in range(layers)])
        self.head = nn.Linear(D, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.__name__.split(".")[0]] += 1
        return func(*args, **(kwargs or {}))


def _counts_and_grads(model: nn.Module, ids: torch.Tensor) -> tuple[Counter, dict]:
    with OpCounter() as counter:
        model(ids).float().pow(2).mean().backward()
    grads = {n.replace("._checkpoint_wrapped_module", ""): p.grad.clone()
             for n, p in model.named_parameters()}
    return counter.counts, grads


@pytest.mark.parametrize("fused", [True, False], ids=["sdpa", "by-hand"])
def test_selective_recomputes_the_attention_core_only(fused: bool) -> None:
    torch.manual_seed(0)
    model = LM(fused)
    ids = torch.randint(0, 64, (2, SEQ))
    graph = autopar.capture(model, (ids,))
    runs = {}
    for mode in ("none", "selective", "full"):
        plan = autopar.plan(graph, devices=1, cluster="cpu", global_batch=2,
                            constraints={"recompute": mode})
        assert set(plan.recompute[1:-1]) == {mode}  # the search kept the pinned mode
        wrapped = copy.deepcopy(model)
        autopar.parallelize(wrapped, plan)  # the program's recompute wrappers
        runs[mode] = _counts_and_grads(wrapped, ids)
    none, selective, full = (runs[m][0] for m in ("none", "selective", "full"))
    layers = len(model.layers)
    # the softmax of the core (SDPA runs its math path under a dispatch mode, so either name)
    for counts in (none, selective, full):
        counts["core"] = sum(counts[k] for k in ("_softmax", "_safe_softmax",
                                                 "_scaled_dot_product_flash_attention_for_cpu"))
    assert none["core"] == layers
    assert selective["core"] == full["core"] == 2 * layers  # the core runs again, every layer
    # the projections are not re-run under selective; under full they are (all but the last
    # of each layer, whose output the backward does not need: checkpoint stops early)
    assert selective["addmm"] == none["addmm"]
    assert full["addmm"] >= none["addmm"] + 3 * layers
    for mode in ("selective", "full"):
        for name, grad in runs["none"][1].items():
            torch.testing.assert_close(runs[mode][1][name], grad, rtol=1e-5, atol=1e-6)
