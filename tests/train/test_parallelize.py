"""``autopar.parallelize`` with pipeline stages: your own loss and loop around the planned
stages and schedule, equal to one process."""

from __future__ import annotations

import pytest

import autopar
from autopar.models import GPT, GPTConfig, token_inputs
from tests.fixtures.harness import record_first_grads, run_in_group, spawn_ranks

pytestmark = pytest.mark.dist
CFG = dict(vocab_size=128, seq_len=32, d_model=64, n_layers=4, n_heads=4)
BATCH, STEPS = 4, 4


def _batches():
    import torch

    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, CFG["vocab_size"], (BATCH, CFG["seq_len"] + 1), generator=g)
            for _ in range(STEPS)]


def _loss(logits, target):
    import torch.nn.functional as F

    return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


def _own_loop(rank: int, port: int, out, world: int, plan_dict: dict | None) -> None:
    run_in_group(rank, port, out, world, _train_gpt, world, plan_dict)


def _train_gpt(world: int, plan_dict: dict | None) -> list[float]:
    import torch
    import torch.distributed as dist

    from autopar.plan import Plan
    from autopar.train.parallelize import optimizer

    torch.manual_seed(0)
    model = GPT(GPTConfig(**CFG))  # every rank builds the same weights
    losses = []
    if plan_dict is None:  # one process, the plain model
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for batch in _batches():
            loss = _loss(model(batch[:, :-1]), batch[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(loss))
        return losses
    plan = Plan.from_dict(plan_dict)
    dp = plan.mesh["dp"]
    mine = dist.get_rank() % (dp * plan.mesh["tp"]) // plan.mesh["tp"]
    share = BATCH // dp
    example = torch.zeros(plan.microbatch_size, CFG["seq_len"], dtype=torch.long)
    pipe = autopar.parallelize(model, plan, example=example, loss_fn=_loss)
    opt = optimizer(pipe, plan, lr=1e-2)
    for batch in _batches():
        rows = batch[mine * share:(mine + 1) * share]
        total = pipe.step(rows[:, :-1], target=rows[:, 1:])
        opt.step()
        opt.zero_grad()
        if dp > 1:
            dist.all_reduce(total, group=pipe.dp_group)
            total /= dp
        losses.append(float(total))
    return losses


@pytest.mark.parametrize("pins", [dict(pp=2, dp=1, tp=1, schedule="1f1b"),
                                  dict(pp=2, dp=2, tp=1, zero_stage=1, schedule="gpipe"),
                                  dict(pp=2, dp=1, tp=2, schedule="1f1b",
                                       sequence_parallel=False),
                                  dict(pp=2, dp=1, tp=1, cp=2, cp_mode="alltoall")],
                         ids=["pp2", "pp2xdp2-zero1", "pp2xtp2", "pp2xcp2-alltoall"])
def test_parallelize_a_pipeline_in_your_own_loop(pins: dict) -> None:
    graph = autopar.capture(GPT(GPTConfig(**CFG)), token_inputs(1, CFG["seq_len"]))
    devices = pins["pp"] * pins["dp"] * pins["tp"] * pins.get("cp", 1)
    plan = autopar.plan(graph, devices=devices, global_batch=BATCH, cluster="cpu",
                        constraints=dict(pins, microbatch_size=1, precision="fp32"))
    assert plan.mesh["pp"] == 2
    reference = spawn_ranks(_own_loop, 1, (1, None))[0]
    losses = spawn_ranks(_own_loop, devices, (devices, plan.to_dict()))[0]
    assert losses == pytest.approx(reference, rel=1e-4)
    assert len(set(losses)) == len(losses)  # every step changed the weights


def _moe_loop(rank: int, port: int, out, world: int, plan_dict: dict | None) -> None:
    run_in_group(rank, port, out, world, _train_moe, world, plan_dict)


def _train_moe(world: int, plan_dict: dict | None) -> tuple[list[float], dict, str]:
    import torch
    import torch.distributed as dist

    from autopar.models import build_model
    from autopar.plan import Plan
    from autopar.train.parallelize import optimizer

    torch.manual_seed(0)
    model = build_model("tiny-mixtral", device="cpu", dtype=torch.float32)
    plan = Plan.from_dict(plan_dict) if plan_dict else None
    if plan is not None:
        model = autopar.parallelize(model, plan)
    opt = optimizer(model, plan, lr=1e-2) if plan else \
        torch.optim.AdamW(model.parameters(), lr=1e-2)
    first = record_first_grads(model, opt)
    replicas = plan.mesh["dp"] * plan.mesh["ep"] if plan else 1
    mine = dist.get_rank() // plan.mesh["tp"] if plan else 0
    losses = []
    g = torch.Generator().manual_seed(3)
    for _ in range(STEPS):
        batch = torch.randint(0, 256, (BATCH, 17), generator=g)
        rows = batch[mine * BATCH // replicas:(mine + 1) * BATCH // replicas]
        loss = _loss(model(rows[:, :-1]).logits, rows[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        if world > 1:
            dist.all_reduce(total)
            total /= world
        losses.append(float(total))
    return losses, first, type(opt).__name__


@pytest.mark.parametrize("zero_stage", [3, 0, 1])
def test_parallelize_experts_in_your_own_loop(zero_stage: int) -> None:
    """Expert parallelism (ep2) applied to your own Mixtral, with ZeRO-3 (fully_shard) and
    ZeRO-0/1 (DDP for the dense weights, the experts' gradients reduced by autopar's optimizer
    as the Trainer does; ZeRO-1's optimizer shards its states over dp x ep and dp): one
    process's losses and first-step gradients."""
    import numpy as np

    graph = autopar.capture("tiny-mixtral", seq=16)
    plan = autopar.plan(graph, devices=2, global_batch=BATCH, cluster="cpu",
                        constraints=dict(ep=2, dp=1, tp=1, pp=1, zero_stage=zero_stage,
                                         microbatch_size=2, precision="fp32"))
    assert (plan.mesh["ep"], plan.zero_stage) == (2, zero_stage)
    reference, ref_grads, _ = spawn_ranks(_moe_loop, 1, (1, None))[0]
    losses, grads, kind = spawn_ranks(_moe_loop, 2, (2, plan.to_dict()))[0]
    assert (kind == "ExpertZeroOptimizer") == (zero_stage == 1)
    assert losses == pytest.approx(reference, rel=1e-4)
    assert set(grads) == set(ref_grads)
    for name, g in ref_grads.items():
        assert np.linalg.norm(grads[name] - g) <= 1e-4 * max(np.linalg.norm(g), 1e-8), name


def _moe_pipeline_loop(rank: int, port: int, out, world: int, plan_dict: dict) -> None:
    run_in_group(rank, port, out, world, _train_moe_pipeline, plan_dict)


def _train_moe_pipeline(plan_dict: dict) -> tuple[list[float], float, str]:
    import torch
    import torch.distributed as dist

    from autopar.models import build_model
    from autopar.plan import Plan
    from autopar.train.parallelize import optimizer

    torch.manual_seed(0)
    model = build_model("tiny-mixtral", device="cpu", dtype=torch.float32)
    plan = Plan.from_dict(plan_dict)
    replicas = plan.mesh["dp"] * plan.mesh["ep"]
    mine = dist.get_rank() // plan.mesh["tp"] % replicas  # this rank's dp x ep rows
    share = BATCH // replicas
    pipe = autopar.parallelize(model, plan, example=torch.zeros(plan.microbatch_size, 16,
                                                                dtype=torch.long),
                               loss_fn=_loss)
    opt = optimizer(pipe, plan, lr=1e-2)
    losses = []
    g = torch.Generator().manual_seed(3)
    for step in range(STEPS):
        batch = torch.randint(0, 256, (BATCH, 17), generator=g)
        rows = batch[mine * share:(mine + 1) * share]
        total = pipe.step(rows[:, :-1], target=rows[:, 1:])
        if step == 0:  # Adam hides a gradient's scale from the losses: its squared norm
            squares = _squared_grad_norm(pipe, plan)
        opt.step()
        opt.zero_grad()
        dist.all_reduce(total, group=pipe.replica_group)
        losses.append(float(total) / replicas)
    return losses, squares, type(opt).__name__


def _squared_grad_norm(pipe, plan) -> float:
    """The whole model's squared gradient norm: each expert shard once, each dense gradient
    once (from the first ep rank; dp = 1 here)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    tp, ep = plan.mesh["tp"], plan.mesh["ep"]
    first_ep = dist.get_rank() // tp % ep == 0
    total = torch.zeros((), dtype=torch.float64)
    for p in pipe.parameters():
        if p.grad is None:
            continue
        if isinstance(p.grad, DTensor):
            total += p.grad.to_local().double().pow(2).sum()
        elif first_ep:
            total += p.grad.double().pow(2).sum()
    dist.all_reduce(total)
    return float(total)


@pytest.mark.parametrize("zero_stage", [0, 1])
def test_parallelize_experts_inside_a_pipeline_in_your_own_loop(zero_stage: int) -> None:
    """pp2 x ep2 under ZeRO-0/1 through autopar.parallelize: the returned pipeline averages the
    dense gradients over the dp x ep replicas and the experts' over dp, as the Trainer does
    (ZeRO-1: the optimizer then shards its states); one process's losses."""
    graph = autopar.capture("tiny-mixtral", seq=16)
    plan = autopar.plan(graph, devices=4, global_batch=BATCH, cluster="cpu",
                        constraints=dict(pp=2, ep=2, dp=1, tp=1, zero_stage=zero_stage,
                                         schedule="1f1b", microbatch_size=1,
                                         precision="fp32"))
    assert (plan.mesh["pp"], plan.mesh["ep"], plan.zero_stage) == (2, 2, zero_stage)
    reference, grads, _ = spawn_ranks(_moe_loop, 1, (1, None))[0]
    losses, squares, kind = spawn_ranks(_moe_pipeline_loop, 4, (4, plan.to_dict()))[0]
    assert (kind == "ExpertZeroOptimizer") == (zero_stage == 1)
    assert losses == pytest.approx(reference, rel=1e-4)
    assert squares == pytest.approx(sum(float((g.astype("float64") ** 2).sum())
                                        for g in grads.values()), rel=1e-4)
