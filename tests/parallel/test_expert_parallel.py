"""Expert parallelism: tiny Mixtral with its experts split over ep ranks and tokens dispatched
by all-to-all reproduces the single-process loss trajectory (fp32, gloo, CPU)."""

from __future__ import annotations

import numpy as np
import pytest
from torch import nn

import autopar
from autopar.models.source import describe_source
from tests.fixtures.collectives import Collectives
from tests.fixtures.harness import run_ranks, spawn_ranks
from tests.fixtures.layouts import with_full_size_layout

pytestmark = pytest.mark.dist
STEPS, BATCH = 5, 4
NUM_EXPERTS, MOE_LAYERS = 4, 4  # tiny-mixtral


@pytest.fixture(scope="module")
def graph():
    return autopar.capture("tiny-mixtral", seq=32)


@pytest.fixture(scope="module")
def mixtral(graph):
    """(source, graph, one process's losses, one process's first-step gradients)."""
    source = describe_source("tiny-mixtral")
    single = _plan(graph, 1, ep=1, microbatch_size=2)
    losses, _ = run_ranks(source, single, STEPS)
    *_, grads = run_ranks(source, single, 0, probe=_gradients)
    return source, graph, losses, grads


def _plan(graph, devices: int, **pins):
    pins = dict(dict(pp=1, tp=1, num_microbatches=2), **pins)
    plan = autopar.plan(graph, devices=devices, global_batch=BATCH,
                        constraints=dict(pins, precision="fp32"))
    if pins["tp"] > 1:  # the full-size Mixtral's attention split; experts stay whole on a rank
        plan = with_full_size_layout(plan, "tiny-mixtral")
    return plan


def _probe(trainer) -> dict:
    """Runs on every rank after training: the experts it holds, and the all-to-alls that one
    more forward performs."""
    import torch
    from torch.distributed.tensor import Shard

    experts = trainer.experts
    assert len(experts) == MOE_LAYERS
    plan = trainer.plan
    shards = plan.mesh["ep"] * (plan.mesh["dp"] if plan.zero_stage >= 2 else 1)
    tp_split = sum(1 for p in trainer.model.parameters() if hasattr(p, "device_mesh")
                   and "tp" in p.device_mesh.mesh_dim_names
                   and p.placements[p.device_mesh.mesh_dim_names.index("tp")].is_shard())
    local_shapes = []
    for module in experts:
        for p in module.parameters():
            mesh = p.device_mesh
            ep_dim = mesh.mesh_dim_names.index("ep")
            assert p.placements[ep_dim] == Shard(0), p.placements
            assert p.shape[0] == NUM_EXPERTS  # the global view still has every expert
            assert p.to_local().numel() * shards == p.numel()  # but this rank stores its share
            local_shapes.append(tuple(p.to_local().shape))
    ids = torch.randint(0, trainer.vocab, (plan.microbatch_size, trainer.seq - 1))
    with torch.no_grad(), Collectives() as comm:
        trainer.model(ids)
    counts = comm.counts
    return dict(local_shapes=local_shapes, tp_split=tp_split,
                all_to_all=sum(n for op, n in counts.items() if "alltoall" in op),
                sent=experts[0].tokens_sent, received=experts[0].tokens_received)


def _gradients(trainer) -> dict:
    """Every parameter's full gradient after the first step's backward and gradient sync
    (the optimizer step and clipping switched off), keyed by its name in the plain model."""
    trainer.grad_clip = 0.0
    trainer.optimizer.step = lambda *a, **k: None
    trainer.optimizer.zero_grad = lambda *a, **k: None
    trainer.train_step()
    grads = {}
    for name, p in trainer.model.named_parameters():
        g = p.grad
        g = g.full_tensor() if hasattr(g, "full_tensor") else g
        # numpy pickles by value: a tensor would travel as shared memory of an exited rank
        grads[name.removeprefix("module.")] = g.detach().numpy().copy()
    return grads


# each reduces the gradients differently: DDP + one all-reduce of the experts over dp,
# or fully_shard with the experts' divide factor (one-rank dp mesh, or a real one)
CASES = {
    "ep2": (2, dict(ep=2, dp=1, zero_stage=0, microbatch_size=1)),
    "ep2 zero3": (2, dict(ep=2, dp=1, zero_stage=3, microbatch_size=1)),
    "ep2 x dp2": (4, dict(ep=2, dp=2, zero_stage=0, microbatch_size=1, num_microbatches=1)),
    "ep2 x dp2 zero3": (4, dict(ep=2, dp=2, zero_stage=3, microbatch_size=1,
                                num_microbatches=1)),
    "ep2 x tp2": (4, dict(ep=2, tp=2, dp=1, zero_stage=0, microbatch_size=1,
                          sequence_parallel=False)),
    "ep2 x tp2 sp": (4, dict(ep=2, tp=2, dp=1, zero_stage=0, microbatch_size=1,
                             sequence_parallel=True)),
}
# the same reductions, with the all-to-alls re-run in the backward, or parameters on the host
MORE_CASES = {
    "ep2 full recompute": (2, dict(ep=2, dp=1, zero_stage=0, microbatch_size=1,
                                   recompute="full")),
    "ep2 zero3 offload optimizer+params": (2, dict(ep=2, dp=1, zero_stage=3, microbatch_size=1,
                                                   offload=["optimizer", "params"])),
}


@pytest.mark.parametrize("case", list(CASES) + list(MORE_CASES))
def test_tiny_mixtral_expert_parallel_matches_single_process(mixtral, case: str) -> None:
    source, graph, reference, _ = mixtral
    devices, pins = {**CASES, **MORE_CASES}[case]
    plan = _plan(graph, devices, **pins)
    assert plan.mesh["ep"] == 2 and plan.zero_stage == pins["zero_stage"]
    assert pins.get("recompute", plan.recompute[1]) == plan.recompute[1]  # first layer
    assert sorted(plan.offload) == sorted(pins.get("offload", []))
    losses, sharded, probe = run_ranks(source, plan, STEPS, probe=_probe)
    assert losses == pytest.approx(reference, rel=1e-4)
    assert losses[0] != losses[-1]  # it trains
    assert sharded >= 2 * MOE_LAYERS  # at least every expert weight is a sharded DTensor
    # tiny-mixtral's gate_up_proj is [4, 256, 64]: 2 of the 4 experts per ep rank
    stored = 2 // (pins["dp"] if pins["zero_stage"] >= 2 else 1)
    assert probe["local_shapes"][0] == (stored, 256, 64)
    # per MoE layer: one count exchange, tokens out, results back
    assert probe["all_to_all"] == 3 * MOE_LAYERS
    tokens = plan.microbatch_size * 31  # the probe's micro-batch, top-2: two copies each
    assert sum(probe["sent"]) == 2 * tokens and sum(probe["received"]) > 0
    assert probe["sent"][1] > 0  # rank 0 really sent token copies to the other expert rank
    # q, k, v and o of every layer (the planner may split the LM head too)
    assert probe["tp_split"] >= 4 * MOE_LAYERS if plan.mesh["tp"] > 1 else not probe["tp_split"]


@pytest.mark.parametrize("pins", [dict(pp=2, zero_stage=0), dict(pp=2, dp=2, zero_stage=3)],
                         ids=["pp2", "pp2 x dp2 zero3"])
def test_mixture_of_experts_pipeline_matches_single_process(mixtral, pins: dict) -> None:
    """A pipeline of MoE layers (experts traced with transformers' grouped-mm kernel, the
    layers split over stages) trains as one process does: losses and first-step gradients."""
    source, graph, reference, _ = mixtral
    devices = pins["pp"] * pins.get("dp", 1)
    plan = _plan(graph, devices, ep=1, microbatch_size=1,
                 num_microbatches=4 // pins.get("dp", 1), **pins)
    assert plan.mesh["pp"] == 2 and plan.zero_stage == pins["zero_stage"]
    # losses and the first step's gradients (clipped, as one process's) from one run
    losses, _, grads = run_ranks(source, plan, STEPS, first_grads=True)
    assert losses == pytest.approx(reference, rel=1e-4)
    *_, reference_grads = run_ranks(source, _plan(graph, 1, ep=1, microbatch_size=2), 1,
                                    first_grads=True)
    assert grads.keys() == reference_grads.keys()
    for name, ref in reference_grads.items():
        assert np.linalg.norm(grads[name] - ref) <= 1e-4 * np.linalg.norm(ref), name


# ZeRO-0 of ep inside stages runs in tests/train/test_router_loss.py (the search's schedule)
PIPELINE_CASES = {
    "1f1b full recompute zero1": dict(zero_stage=1, schedule="1f1b", recompute="full"),
    "zero3": dict(zero_stage=3),
    "zero-bubble zero2": dict(zero_stage=2, schedule="zero_bubble"),
}


@pytest.mark.parametrize("case", list(PIPELINE_CASES))
def test_expert_parallel_inside_pipeline_stages_matches_single_process(mixtral,
                                                                       case: str) -> None:
    """pp2 x ep2 (4 processes): each traced stage gets its experts back as the original
    modules, split over ep with the all-to-all dispatch; dense gradients averaged over the
    ep replicas (an all-reduce after the schedule's step, or fully_shard over dp x ep). The
    search's schedule holds several stages per rank, the embedding's and the head's without
    experts. Losses and every first-step gradient equal one process's."""
    source, graph, reference, _ = mixtral
    pins = PIPELINE_CASES[case]
    plan = _plan(graph, 4, pp=2, ep=2, dp=1, microbatch_size=1, **pins)
    assert (plan.mesh["pp"], plan.mesh["ep"], plan.zero_stage) == (2, 2, pins["zero_stage"])
    assert plan.schedule == pins.get("schedule", plan.schedule)
    assert pins.get("recompute", "none") in plan.recompute
    losses, sharded, grads, probe = run_ranks(source, plan, STEPS, first_grads=True,
                                              probe=_stage_probe, timeout_s=400)
    assert losses == pytest.approx(reference, rel=1e-4)
    assert losses[0] != losses[-1]  # it trains
    # rank 0 (first pipeline rank) holds MoE layers: 2 of its 4 experts' weights each
    assert probe["experts"] >= 1 and sharded >= 2 * probe["experts"]
    assert probe["local_experts"] == {NUM_EXPERTS // 2}
    *_, reference_grads = run_ranks(source, _plan(graph, 1, ep=1, microbatch_size=2), 1,
                                    first_grads=True)
    assert grads.keys() == reference_grads.keys()
    assert any(".experts." in name for name in grads)
    for name, ref in reference_grads.items():
        assert np.linalg.norm(grads[name] - ref) <= 1e-4 * np.linalg.norm(ref), name


ZERO1_CASES = {
    "ep2 zero1": (2, dict(ep=2, dp=1, zero_stage=1, microbatch_size=1)),
    "ep2 x dp2 zero1": (4, dict(ep=2, dp=2, zero_stage=1, microbatch_size=1,
                                num_microbatches=1)),
}


@pytest.mark.parametrize("case", list(ZERO1_CASES))
def test_expert_parallel_zero1_matches_single_process(mixtral, case: str) -> None:
    """ZeRO-1 under expert parallelism: the ZeRO-0 gradient sync (DDP over dp x ep for the
    dense weights, the experts' over dp), then each parameter's optimizer states held and
    stepped by one owner: a dense one's among the dp x ep ranks, an expert shard's among the
    dp ranks holding it; the owner broadcasts the new values. Losses and every first-step
    gradient equal one process's, and each rank holds only its share of the states."""
    source, graph, reference, _ = mixtral
    devices, pins = ZERO1_CASES[case]
    plan = _plan(graph, devices, **pins)
    assert (plan.mesh["ep"], plan.mesh["dp"], plan.zero_stage) == (2, pins["dp"], 1)
    losses, sharded, grads, probe = run_ranks(source, plan, STEPS, first_grads=True,
                                              probe=_zero1_probe)
    assert losses == pytest.approx(reference, rel=1e-4)
    assert losses[0] != losses[-1]  # it trains
    assert sharded >= 2 * MOE_LAYERS  # the experts are split over ep
    *_, reference_grads = run_ranks(source, _plan(graph, 1, ep=1, microbatch_size=2), 1,
                                    first_grads=True)
    assert grads.keys() == reference_grads.keys()
    assert any(".experts." in name for name in grads)
    for name, ref in reference_grads.items():
        assert np.linalg.norm(grads[name] - ref) <= 1e-4 * np.linalg.norm(ref), name
    # each dense parameter has one owner among the dp x ep ranks, each expert shard one
    # among the dp ranks holding it; a rank keeps states for what it owns, nothing else
    dense, experts = probe["dense"], probe["experts"]
    assert sum(probe["owned"]) == dense + experts * plan.mesh["ep"]
    assert all(0 < n < dense + experts for n in probe["owned"])
    assert probe["states"] == probe["owned"]


def _zero1_probe(trainer) -> dict:
    """Every rank's count of the parameters whose optimizer states it holds, and how many
    dense and expert parameters the model has."""
    import torch.distributed as dist

    from autopar.parallel.expert_zero import ExpertZeroOptimizer, is_expert_parameter

    opt = trainer.optimizer
    assert isinstance(opt, ExpertZeroOptimizer)
    params = [p for g in opt.param_groups for p in g["params"]]
    mine = (sum(len(g["params"]) for g in opt.optim.param_groups), len(opt.optim.state))
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    experts = sum(1 for p in params if is_expert_parameter(p))
    return dict(owned=[n for n, _ in everyone], states=[n for _, n in everyone],
                dense=len(params) - experts, experts=experts)


def test_expert_parallel_zero1_checkpoint_resumes(mixtral, tmp_path) -> None:
    """A dp2 x ep2 ZeRO-1 checkpoint (each rank writing the states it owns) resumes under
    ep2 ZeRO-1, its states partitioned over other owners: one process's losses."""
    source, graph, reference, _ = mixtral
    ckpt = str(tmp_path / "ckpt")
    first, _ = run_ranks(source, _plan(graph, 4, **ZERO1_CASES["ep2 x dp2 zero1"][1]), steps=3,
                         checkpoint_dir=ckpt, timeout_s=400)
    rest, _ = run_ranks(source, _plan(graph, 2, **ZERO1_CASES["ep2 zero1"][1]), steps=2,
                        checkpoint_dir=ckpt, resume=True)
    assert first + rest == pytest.approx(reference, rel=1e-4)


def _stage_probe(trainer) -> dict:
    """This rank's expert-parallel experts: how many, and how many experts each stores."""
    from autopar.parallel.expert_parallel import ExpertParallelExperts

    experts = [m for m in trainer.model.modules() if isinstance(m, ExpertParallelExperts)]
    assert experts == trainer.experts
    return dict(experts=len(experts), local_experts={m.num_local for m in experts})


@pytest.mark.parametrize("case", list(CASES))
def test_expert_parallel_gradients_match_single_process(mixtral, case: str) -> None:
    """Adam barely notices a constant gradient scale, so the losses alone would not catch an
    expert gradient averaged over the wrong ranks: compare the gradients themselves."""
    source, graph, _, reference = mixtral
    devices, pins = CASES[case]
    *_, grads = run_ranks(source, _plan(graph, devices, **pins), 0, probe=_gradients)
    assert grads.keys() == reference.keys()
    assert any(".experts." in name for name in grads)
    for name, ref in reference.items():
        assert np.linalg.norm(grads[name] - ref) <= 1e-4 * np.linalg.norm(ref), name


def test_expert_parallel_checkpoint_resumes_in_one_process(mixtral, tmp_path) -> None:
    """Experts saved as ep-sharded DTensors load, whole, into a single process."""
    source, graph, reference, _ = mixtral
    ckpt = str(tmp_path / "ckpt")
    first, _ = run_ranks(source, _plan(graph, 2, ep=2, dp=1, zero_stage=0, microbatch_size=1),
                         steps=3, checkpoint_dir=ckpt)
    rest, _ = run_ranks(source, _plan(graph, 1, ep=1, microbatch_size=2), steps=2,
                        checkpoint_dir=ckpt, resume=True)
    assert first + rest == pytest.approx(reference, rel=1e-4)


def test_pipeline_expert_parallel_checkpoint_resumes_in_one_process(mixtral, tmp_path) -> None:
    """pp2 x ep2 stages save their ep-sharded experts; one process loads them whole."""
    source, graph, reference, _ = mixtral
    ckpt = str(tmp_path / "ckpt")
    first, _ = run_ranks(source, _plan(graph, 4, pp=2, ep=2, dp=1, zero_stage=0,
                                       microbatch_size=1), steps=3, checkpoint_dir=ckpt,
                         timeout_s=400)
    rest, _ = run_ranks(source, _plan(graph, 1, ep=1, microbatch_size=2), steps=2,
                        checkpoint_dir=ckpt, resume=True)
    assert first + rest == pytest.approx(reference, rel=1e-4)


def _dispatch_worker(rank: int, port: int, out, skew: bool) -> None:
    """One rank of a 2-rank check of ExpertParallelExperts against the original module on the
    union of both ranks' tokens: outputs, and the gradients of the tokens, the top-k weights
    and the experts (each rank's experts collect the gradient of both ranks' tokens)."""
    import os
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    from autopar.parallel.expert_parallel import ExpertParallelExperts

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    try:
        torch.manual_seed(0)  # the same tokens, routes and weights on both ranks
        cfg = MixtralConfig(hidden_size=8, intermediate_size=16, num_local_experts=4,
                            num_experts_per_tok=2)
        experts = MixtralExperts(cfg)  # eager: no _experts_implementation outside a model
        for weight in experts.parameters():
            nn.init.normal_(weight)
        n = 6  # tokens per rank
        x = torch.randn(2 * n, 8, requires_grad=True)
        w = torch.rand(2 * n, 2, requires_grad=True)
        # skew: every token picks experts 0 and 1, so rank 1's experts receive nothing
        idx = torch.tensor([[0, 1]] * 2 * n) if skew else \
            torch.stack([torch.randperm(4)[:2] for _ in range(2 * n)])
        cot = torch.randn(2 * n, 8)
        y_ref = experts(x, idx, w)
        (y_ref * cot).sum().backward()
        ref_grads = {name: p.grad.clone() for name, p in experts.named_parameters()}
        ep = ExpertParallelExperts(experts, init_device_mesh("cpu", (2,), mesh_dim_names=("ep",)),
                                   4)
        rows = slice(rank * n, (rank + 1) * n)
        xr, wr = x.detach()[rows].requires_grad_(), w.detach()[rows].requires_grad_()
        y = ep(xr, idx[rows], wr)
        (y * cot[rows]).sum().backward()
        pairs = {"out": (y, y_ref[rows]), "tokens": (xr.grad, x.grad[rows]),
                 "weights": (wr.grad, w.grad[rows])}
        for name, p in ep.named_parameters():
            pairs[name] = (p.grad.to_local(), ref_grads[name][2 * rank:2 * rank + 2])
        errors = {k: float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))
                  for k, (a, b) in pairs.items()}  # relative to the largest entry
        out.put(("ok", (rank, errors, ep.tokens_received)))
    except Exception as exc:  # reported to the test as text
        out.put(("error", f"rank {rank}: {type(exc).__name__}: {exc}"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("skew", [False, True], ids=["spread", "one rank idle"])
def test_dispatch_matches_the_original_experts(skew: bool) -> None:
    results = sorted(spawn_ranks(_dispatch_worker, 2, (skew,), 120, replies=2))
    for rank, errors, _ in results:
        assert isinstance(errors, dict), errors
        assert max(errors.values()) < 1e-5, (rank, errors)
    if skew:
        assert sum(results[1][2]) == 0  # rank 1 really received no token, and did not hang
    else:
        assert all(sum(received) > 0 for _, _, received in results)


class _ListMoE(nn.Module):
    """Experts as a ModuleList (transformers 4 style), which the runtime cannot split."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))


def test_expert_modules_it_cannot_split_are_refused() -> None:
    from autopar.parallel.expert_parallel import apply_expert_parallel, find_experts

    with pytest.raises(autopar.PlanError, match="nn.ModuleList.*ep=1"):
        find_experts(_ListMoE())
    plan = type("P", (), {"mesh": {"ep": 2}})()
    with pytest.raises(autopar.PlanError, match="no expert modules.*ep=1"):
        apply_expert_parallel(nn.Sequential(nn.Linear(4, 4)), plan, ep_mesh=None)


def test_pipeline_stage_keeping_its_experts_whole_is_refused(graph) -> None:
    """A pipeline lay-out that does not split a stage's experts under an ep plan (as
    autopar.parallelize's own pipeline path does not) is refused before any stage is built,
    rather than training a different copy of the experts on each ep rank."""
    import types

    import torch

    from autopar.models.source import build_from_source
    from autopar.parallel.pipeline import build_pipeline

    plan = _plan(graph, 4, pp=2, ep=2, dp=1, zero_stage=0, microbatch_size=1)
    model = build_from_source(describe_source("tiny-mixtral"), 0, "meta")
    rank_zero = types.SimpleNamespace(get_local_rank=lambda: 0)
    example = torch.zeros(1, 31, dtype=torch.long)
    with pytest.raises(autopar.PlanError, match=r"holds model\.layers\.\d\.mlp\.experts whole"):
        build_pipeline(model, plan, rank_zero, "cpu", example, None, lambda stage: None)


def test_traced_experts_inputs_are_put_in_forward_order() -> None:
    """The trace orders a stage's inputs its own way: the expert index is the one integer
    tensor, the weights the float tensor shaped like it; anything ambiguous is None."""
    import torch

    from autopar.parallel.stage_experts import _forward_order

    hidden, index, weights = torch.zeros(31, 64), torch.zeros(31, 2, dtype=torch.long), \
        torch.zeros(31, 2)
    assert _forward_order([hidden, index, weights]) == [0, 1, 2]
    assert _forward_order([hidden, weights, index]) == [0, 2, 1]
    assert _forward_order([weights, index, hidden]) == [2, 1, 0]
    assert _forward_order([torch.zeros(31, 2), index, weights]) is None  # hidden size 2 = k
    assert _forward_order([hidden, index]) is None


@pytest.mark.parametrize("ep", [2], ids=["pp2 x ep2"])  # the stages without ep trace alike
def test_mixture_of_experts_pipeline_trains_in_bf16(mixtral, ep: int) -> None:
    """The planner's default precision, bf16 autocast, through a pipeline of MoE layers: the
    stages are traced in fp32, so the router's ``logits.float()`` must convert the bf16 logits
    at run time rather than assert the traced dtype. Losses follow one bf16 process as the
    dense bf16 layouts do (test_precision), and the fp32 run."""
    source, graph, fp32, _ = mixtral
    single, _ = run_ranks(source, _bf16_plan(graph, 1, ep=1, microbatch_size=2), STEPS)
    plan = _bf16_plan(graph, 2 * ep, pp=2, ep=ep, dp=1, microbatch_size=1,
                      num_microbatches=4 // ep, zero_stage=0)
    assert plan.precision["compute"] == "bf16" and (plan.mesh["pp"], plan.mesh["ep"]) == (2, ep)
    losses, _ = run_ranks(source, plan, STEPS, timeout_s=400)
    assert np.isfinite(losses).all()
    assert losses == pytest.approx(single, rel=0.01)
    assert losses == pytest.approx(fp32, rel=0.02)
    assert losses != pytest.approx(fp32, rel=1e-6)  # it really ran in bf16


def _bf16_plan(graph, devices: int, **pins):
    """A plan at the planner's default precision for a bf16 cluster (bf16 compute)."""
    pins = dict(dict(pp=1, tp=1, num_microbatches=2), **pins)
    return autopar.plan(graph, devices=devices, global_batch=BATCH, constraints=pins)
