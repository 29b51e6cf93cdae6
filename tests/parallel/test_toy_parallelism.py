"""The runtime of docs/architecture.md's toy parallelism (examples/toy_parallelism): on 2 gloo
ranks under a ZeRO-3 plan from the search, keeping the last layer gathered drops exactly the
one all-gather its cost module prices away per micro-batch, and the gradients stay the same.
(tests/test_examples.py adds the whole toy to a copy of autopar and trains with it.)"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

import autopar
from tests.fixtures.harness import run_in_group, spawn_ranks

pytestmark = pytest.mark.dist

RUNTIME = Path(__file__).resolve().parents[2] / "examples" / "toy_parallelism" / "parallel" / \
    "last_layer_gathered.py"


def _gathers_and_grads(plan_dict: dict, keep: bool) -> tuple[int, float]:
    """(all-gathers in one forward and backward, the squared gradient norm) of tiny Llama
    laid out by the plan, with the toy's apply when ``keep``."""
    import torch

    from autopar.models.source import build_from_source, describe_source
    from autopar.train.parallelize import parallelize
    from tests.fixtures.collectives import Collectives

    spec = importlib.util.spec_from_file_location("last_layer_gathered", RUNTIME)
    toy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(toy)
    plan = autopar.Plan.from_dict(plan_dict)
    model = parallelize(build_from_source(describe_source("tiny-llama"), seed=0), plan)
    toy.apply(model, None, plan, keep)
    ids = torch.arange(32).reshape(2, 16) % 200
    with Collectives() as counter:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    gathers = sum(n for op, n in counter.counts.items() if "gather" in op)
    norm = sum(float((p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad)
                     .pow(2).sum()) for p in model.parameters())
    return gathers, norm


def _rank(rank: int, port: int, out, world: int, plan_dict: dict) -> None:
    run_in_group(rank, port, out, world,
                 lambda: (_gathers_and_grads(plan_dict, False),
                          _gathers_and_grads(plan_dict, True)))


def test_keeping_the_last_layer_gathered_drops_one_all_gather() -> None:
    plan = autopar.plan("tiny-llama", devices=2, cluster="cpu", seq=16, global_batch=2,
                        constraints="dp=2,zero_stage=3,precision=fp32,recompute=none")
    assert plan.zero_stage == 3 and plan.num_microbatches == 1
    (plain, plain_norm), (kept, kept_norm) = spawn_ranks(_rank, 2, (2, plan.to_dict()), timeout_s=120)[0]
    layers = len(plan.layers)
    assert plain >= 2 * layers  # each layer gathered for its forward and again for its backward
    assert kept == plain - 1
    assert kept_norm == pytest.approx(plain_norm, rel=1e-6)
