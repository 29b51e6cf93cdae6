"""Expert capacity with token dropping: the copies kept equal a plain GShard reference on the same
router logits; a factor that leaves room for every copy changes nothing; training with a
capacity under plans drawn from the search equals one process (losses, first-step gradients,
the share of copies dropped)."""

from __future__ import annotations

import pytest
import torch

from autopar.errors import PlanError
from autopar.models.source import build_from_source, describe_source
from autopar.train.expert_capacity import expert_capacity, install_capacity, kept_copies
from autopar.train.optim import Hyperparameters
from autopar.train.router_loss import routing_shape
from tests.fixtures.harness import differing_gradients, last_record, run_ranks
from tests.fixtures.moe import SEQ, mixtral_one_process, mixtral_plan

STEPS = 3
HYPER = dict(capacity_factor=1.0)


def _gshard_reference(top_k_index: torch.Tensor, experts: int, capacity: int) -> torch.Tensor:
    """GShard's dispatch written out: choice by choice, token by token, each expert keeps a
    copy while it has room."""
    groups, tokens, k = top_k_index.shape
    keep = torch.zeros(groups, tokens, k, dtype=torch.bool)
    for g in range(groups):
        load = [0] * experts
        for choice in range(k):
            for t in range(tokens):
                e = int(top_k_index[g, t, choice])
                if load[e] < capacity:
                    keep[g, t, choice] = True
                    load[e] += 1
    return keep


@pytest.mark.parametrize("experts,k,factor", [(4, 2, 1.0), (8, 2, 1.25), (8, 1, 0.5),
                                              (4, 1, 2.0)])
def test_kept_copies_equal_gshard_on_the_same_router_logits(experts, k, factor) -> None:
    logits = torch.randn(3, 40, experts, generator=torch.Generator().manual_seed(experts + k))
    logits[..., 0] += 1.5  # a favoured expert: its queue overflows
    top_k_index = torch.topk(torch.softmax(logits, -1), k, dim=-1).indices
    capacity = expert_capacity(40, k, experts, factor)
    keep = kept_copies(top_k_index, experts, capacity)
    reference = _gshard_reference(top_k_index, experts, capacity)
    assert torch.equal(keep, reference)
    assert int((~keep).sum()) == int((~reference).sum()) > 0
    # no expert takes more than its capacity from any group
    kept = torch.where(keep, top_k_index, -1)
    for e in range(experts):
        assert int((kept == e).sum(dim=(1, 2)).max()) <= capacity


def _tiny_mixtral():
    model = build_from_source(describe_source("tiny-mixtral"), 0, "cpu")
    ids = torch.randint(0, model.config.vocab_size, (2, SEQ), generator=torch.Generator()
                        .manual_seed(1))
    return model, ids


def test_room_for_every_copy_changes_nothing_and_less_room_drops() -> None:
    model, ids = _tiny_mixtral()
    experts, k = routing_shape(model)
    with torch.no_grad():
        dropless = model(ids).logits
        # a capacity of a whole sequence: no expert can be chosen more often than that
        counter = install_capacity(model, experts / k, experts, k)
        roomy = model(ids).logits
    routed, dropped = counter.take()
    assert routed == 2 * SEQ * k * model.config.num_hidden_layers and dropped == 0
    assert torch.equal(roomy, dropless)
    model, ids = _tiny_mixtral()
    with torch.no_grad():
        counter = install_capacity(model, 0.5, experts, k)
        tight = model(ids).logits
    routed, dropped = counter.take()
    assert 0 < dropped < routed
    assert not torch.allclose(tight, dropless, atol=1e-4)


def test_bad_capacity_settings_are_refused_in_one_line() -> None:
    with pytest.raises(PlanError, match="capacity factor must be more than 0"):
        Hyperparameters(capacity_factor=0.0)
    dense = build_from_source(describe_source("tiny-llama"), 0, "meta")
    with pytest.raises(PlanError, match="routes no tokens to experts") as info:
        install_capacity(dense, 1.0, *routing_shape(dense))
    assert "\n" not in str(info.value)


@pytest.fixture(scope="module")
def one_process() -> tuple:
    return mixtral_one_process(STEPS, HYPER)


@pytest.mark.dist
@pytest.mark.parametrize("pins", [dict(ep=2, dp=1, tp=1, pp=1, cp=1),
                                  dict(dp=2, tp=1, ep=1, pp=1, cp=1, zero_stage=1),
                                  dict(tp=2, dp=1, ep=1, pp=1, cp=1, sequence_parallel=True)],
                         ids=["ep2", "dp2-zero1", "tp2-sp"])
def test_capacity_under_drawn_plans_equals_one_process(pins: dict, one_process) -> None:
    """The one-process reference runs with --capacity-factor; the ep2 plan is searched with
    the capacity factor as a constraint and runs without the flag: the generated program
    drops at the plan's factor."""
    plain, (ref_losses, _, ref_grads, ref_record) = one_process
    # copies were dropped, and that changed training
    assert 0 < ref_record["expert_dropped_share"] < 1
    assert abs(ref_losses[-1] - plain[-1]) > 1e-4
    from_plan = pins.get("ep", 1) > 1
    plan = mixtral_plan(2, microbatch_size=1, **pins, **(HYPER if from_plan else {}))
    for axis, degree in pins.items():
        assert plan.mesh.get(axis, 1) == degree
    assert plan.capacity_factor == (HYPER["capacity_factor"] if from_plan else None)
    losses, _, grads, record = run_ranks(describe_source("tiny-mixtral"), plan, STEPS,
                                         first_grads=True, hyper=None if from_plan else HYPER,
                                         probe=last_record)
    assert losses == pytest.approx(ref_losses, abs=1e-4)
    assert record["expert_dropped_share"] == pytest.approx(ref_record["expert_dropped_share"])
    assert not differing_gradients(ref_grads, grads)


def _sent_and_kept(trainer) -> tuple[int, int, int]:
    """One more forward on every rank: (copies this rank sent in the all-to-alls, copies its
    experts' capacity kept, copies dropped), over all MoE layers."""
    ids = torch.randint(0, trainer.vocab, (1, trainer.seq - 1))
    trainer.capacity.take()
    with torch.no_grad():
        trainer.model(ids)
    routed, dropped = trainer.capacity.take()
    return sum(sum(m.tokens_sent) for m in trainer.experts), routed - dropped, dropped


@pytest.mark.dist
def test_dropped_copies_are_not_sent_under_expert_parallelism() -> None:
    plan = mixtral_plan(2, ep=2, dp=1, tp=1, pp=1, cp=1, microbatch_size=1)
    *_, (sent, kept, dropped) = run_ranks(describe_source("tiny-mixtral"), plan, 1,
                                          hyper=HYPER, probe=_sent_and_kept)
    assert dropped > 0 and sent == kept


def _parallelized_drops(rank: int, port: int, out, world: int, plan_dict: dict) -> None:
    from tests.fixtures.harness import run_in_group

    run_in_group(rank, port, out, world, _drops_under, plan_dict)


def _drops_under(plan_dict: dict) -> list:
    """The parallelized model's output and dropped copies on one batch (your own loop)."""
    import autopar
    from autopar.plan import Plan
    from autopar.train.parallelize import CAPACITY_ATTR

    torch.manual_seed(0)
    model = build_from_source(describe_source("tiny-mixtral"), 0, "cpu")
    model = autopar.parallelize(model, Plan.from_dict(plan_dict))
    ids = torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(3))
    logits = model(ids).logits
    counter = getattr(model, CAPACITY_ATTR, None)
    routed, dropped = counter.take() if counter is not None else (0, 0)
    return [logits.detach().tolist(), routed, dropped]


@pytest.mark.dist
def test_parallelize_drops_at_the_plans_capacity() -> None:
    """autopar.parallelize installs the plan's capacity in your own loop: under ep2 the logits
    and the dropped copies equal one process with the same plan's factor, and differ from
    dropless routing."""
    from tests.fixtures.harness import spawn_ranks

    capped = mixtral_plan(1, microbatch_size=1, **HYPER)
    (single,) = spawn_ranks(_parallelized_drops, 1, (1, capped.to_dict()))
    (dropless,) = spawn_ranks(_parallelized_drops, 1, (1, mixtral_plan(1, microbatch_size=1)
                                                        .to_dict()))
    assert single[2] > 0 and dropless[2] == 0
    assert not torch.allclose(torch.tensor(single[0]), torch.tensor(dropless[0]), atol=1e-4)
    plan = mixtral_plan(2, ep=2, dp=1, tp=1, pp=1, cp=1, microbatch_size=1, **HYPER)
    (split,) = spawn_ranks(_parallelized_drops, 2, (2, plan.to_dict()))
    assert torch.allclose(torch.tensor(split[0]), torch.tensor(single[0]), atol=1e-5)
    assert split[2] == single[2]  # every rank routes the same two sequences here


@pytest.mark.dist
def test_capacity_refuses_split_sequences() -> None:
    plan = mixtral_plan(2, cp=2, dp=1, tp=1, ep=1, pp=1, microbatch_size=1)
    with pytest.raises(RuntimeError, match="counted per whole sequence"):
        run_ranks(describe_source("tiny-mixtral"), plan, 1, hyper=HYPER)
