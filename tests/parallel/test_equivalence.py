"""Every parallel mode reproduces the single-process loss trajectory (fp32, gloo, CPU)."""

from __future__ import annotations

import pytest
import torch

import autopar
from autopar.models import GPT, GPTConfig, token_inputs
from autopar.models.source import describe_source
from tests.fixtures.harness import run_ranks
from tests.fixtures.layouts import with_full_size_layout

pytestmark = pytest.mark.dist
STEPS, BATCH = 5, 4


@pytest.fixture(scope="module")
def llama():
    return describe_source("tiny-llama"), autopar.capture("tiny-llama", seq=32)


def _plan(graph, devices: int, **pins):
    pins.setdefault("pp", 1)
    pins.setdefault("num_microbatches", 2)
    pins.setdefault("precision", "fp32")  # compared with one fp32 process
    return autopar.plan(graph, devices=devices, global_batch=BATCH, constraints=pins)


def _init_probe(trainer) -> dict:
    """What this rank allocated when it materialized the meta model, next to the whole model's
    fp32 bytes, and its rotary inv_freq buffers (non-persistent: only materialize fills them)."""
    report = trainer.init_report
    tensors = [*trainer.model.parameters(), *trainer.model.buffers()]
    return {"local": report.local_bytes, "peak_unit": report.peak_unit_bytes,
            "model": 4 * trainer.plan.model["params"], "meta": any(t.is_meta for t in tensors),
            "inv_freq": {n.removeprefix("module."): b.tolist() for n, b in
                         trainer.model.named_buffers() if n.endswith("inv_freq")}}


def _check_init(init: dict, sharded: bool) -> None:
    assert not init["meta"]  # everything was allocated
    assert init["peak_unit"] < init["model"] / 4  # one module at a time, never the model
    if sharded:  # this rank allocated only its shards
        assert init["local"] < 0.75 * init["model"], init
    else:
        assert init["local"] >= init["model"]


@pytest.fixture(scope="module")
def gpt_reference(gpt):
    source, graph = gpt
    return run_ranks(source, _plan(graph, 1, microbatch_size=2), STEPS)[0]


GPT_CASES = {
    "dp2": dict(dp=2, zero_stage=0, microbatch_size=1),
    "dp2 zero1": dict(dp=2, zero_stage=1, microbatch_size=1),
    "dp2 zero2": dict(dp=2, zero_stage=2, microbatch_size=1),
    "dp2 zero3": dict(dp=2, zero_stage=3, microbatch_size=1),
    "dp2 full recompute": dict(dp=2, zero_stage=0, microbatch_size=1, recompute="full"),
    "dp2 selective recompute": dict(dp=2, zero_stage=3, microbatch_size=1,
                                    recompute="selective"),
    "dp2 zero3 offload optimizer+params": dict(dp=2, zero_stage=3, microbatch_size=1,
                                               offload=["optimizer", "params"]),
    "dp2 offload activations": dict(dp=2, zero_stage=2, microbatch_size=1,
                                    offload=["activations", "optimizer"]),
    "tp2": dict(tp=2, dp=1, microbatch_size=2, sequence_parallel=False),
    "tp2 recompute": dict(tp=2, dp=1, microbatch_size=2, recompute="full",
                          sequence_parallel=False),
}


@pytest.mark.parametrize("case", list(GPT_CASES))
def test_gpt_matches_single_process(gpt, gpt_reference, case: str) -> None:
    source, graph = gpt
    pins = GPT_CASES[case]
    plan = _plan(graph, 2, **pins)
    if pins.get("tp", 1) > 1:
        plan = with_full_size_layout(plan, "gpt")
    losses, sharded, init = run_ranks(source, plan, STEPS, probe=_init_probe)
    assert losses == pytest.approx(gpt_reference, rel=1e-4)
    assert losses[0] != losses[-1]  # it trains
    split = pins.get("tp", 1) > 1 or pins.get("zero_stage", 0) >= 2
    if split:
        assert sharded > 0  # the parameters really are split
    _check_init(init, split)


def test_tiny_llama_tp2_x_dp2_zero3_matches_single_process(llama) -> None:
    source, graph = llama
    reference, _ = run_ranks(source, _plan(graph, 1, microbatch_size=2), STEPS)
    plan = with_full_size_layout(_plan(graph, 4, tp=2, dp=2, zero_stage=3, microbatch_size=1,
                                       sequence_parallel=False), "tiny-llama")
    losses, sharded, init = run_ranks(source, plan, STEPS, probe=_init_probe)
    assert losses == pytest.approx(reference, rel=1e-4) and sharded > 0
    _check_init(init, sharded=True)
    from autopar.models import build_model

    built = dict(build_model("tiny-llama", device="cpu").named_buffers())
    assert init["inv_freq"] and all(torch.equal(torch.tensor(b), built[n]) for n, b in
                                 init["inv_freq"].items())


def test_world_size_mismatch_is_refused_before_work(gpt) -> None:
    import torch.distributed as dist  # noqa: F401  (no process group: world size 1)

    from autopar.train import Trainer

    source, graph = gpt
    with pytest.raises(autopar.PlanError, match="torchrun --nproc-per-node 2"):
        Trainer(source, _plan(graph, 2, dp=2, microbatch_size=1), program=None,
                device="cpu")


@pytest.fixture(scope="module")
def gpt4():
    cfg = GPTConfig(vocab_size=128, seq_len=32, d_model=64, n_layers=4, n_heads=4)
    model = GPT(cfg)  # tied embedding and head: the pipeline must sum the copies' gradients
    source, graph = describe_source(model), autopar.capture(model, token_inputs(1, 32))
    reference, _ = run_ranks(source, _plan(graph, 1, microbatch_size=1, num_microbatches=4),
                             STEPS)
    return source, graph, reference


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved", "zero_bubble"])
def test_pipeline_schedules_match_single_process(gpt4, schedule: str) -> None:
    source, graph, reference = gpt4
    plan = _plan(graph, 2, pp=2, dp=1, tp=1, microbatch_size=1, num_microbatches=4,
                 schedule=schedule)
    assert plan.schedule == schedule
    losses, _ = run_ranks(source, plan, STEPS)
    assert losses == pytest.approx(reference, rel=1e-4)


@pytest.mark.parametrize("pins", [dict(pp=2, dp=2, zero_stage=3, num_microbatches=2),
                                  dict(pp=4, dp=1, num_microbatches=4)], ids=["pp2xdp2", "pp4"])
def test_pipeline_combinations_match_single_process(gpt4, pins: dict) -> None:
    source, graph, reference = gpt4
    plan = _plan(graph, 4, tp=1, microbatch_size=1, schedule="1f1b", **pins)
    losses, _, init = run_ranks(source, plan, STEPS, probe=_init_probe)
    assert losses == pytest.approx(reference, rel=1e-4)
    _check_init(init, sharded=True)  # a stage's modules (and their dp shard) only


def test_tiny_mixtral_dp2_zero3_matches_single_process() -> None:
    """An MoE model under data parallelism (expert parallelism itself is not in the runtime)."""
    source, graph = describe_source("tiny-mixtral"), autopar.capture("tiny-mixtral", seq=32)
    reference, _ = run_ranks(source, _plan(graph, 1, microbatch_size=2, ep=1), STEPS)
    plan = _plan(graph, 2, dp=2, ep=1, tp=1, zero_stage=3, microbatch_size=1)
    losses, sharded = run_ranks(source, plan, STEPS)
    assert losses == pytest.approx(reference, rel=1e-4) and sharded > 0


def _wrapping_probe(trainer) -> dict:
    """How this rank's data parallelism is really built: replicated (DDP, or a pipeline's
    gradient all-reduce), the sharded optimizer, fully_shard's reshard flag and offload."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.optim import ZeroRedundancyOptimizer

    modules = list(trainer.model.modules())
    fsdp = [m for m in modules if isinstance(m, FSDPModule)]
    groups = [m._get_fsdp_state()._fsdp_param_group for m in fsdp]
    groups = [g for g in groups if g is not None]
    return {"replicated": getattr(trainer, "replicated", False) or any(
                isinstance(m, torch.nn.parallel.DistributedDataParallel) for m in modules),
            "zero_optimizer": isinstance(trainer.optimizer, ZeroRedundancyOptimizer),
            "reshard": sorted({bool(g.post_forward_mesh_info) for g in groups}),
            "offload": sorted({type(g.offload_policy).__name__ for g in groups})}


PIPELINE_DP = {  # what the plan says -> what must be built
    "pp2xdp2 zero0 1f1b": (dict(dp=2, zero_stage=0, schedule="1f1b"),
                           dict(replicated=True, zero_optimizer=False, reshard=[], offload=[])),
    "pp2xdp2 zero1 zero-bubble": (dict(dp=2, zero_stage=1, schedule="zero_bubble"),
                                  dict(replicated=True, zero_optimizer=True, reshard=[], offload=[])),
    "pp2xdp2 zero2 interleaved": (dict(dp=2, zero_stage=2, schedule="interleaved",
                                       virtual_stages=2),
                                  dict(replicated=False, zero_optimizer=False, reshard=[False],
                                       offload=["OffloadPolicy"])),
    "pp2 offload": (dict(dp=1, zero_stage=0, schedule="1f1b", offload=["optimizer", "params"],
                         num_microbatches=4),
                    dict(replicated=False, zero_optimizer=False, reshard=[False],
                         offload=["CPUOffloadPolicy"])),
}


@pytest.mark.parametrize("case", list(PIPELINE_DP))
def test_pipelines_honour_the_planned_zero_stage_and_offload(gpt4, case: str) -> None:
    """pp x ZeRO 0/1/2 and pp x offload run as planned (DDP, the sharded optimizer,
    fully_shard without resharding, CPU offload) and equal one process."""
    source, graph, reference = gpt4
    pins, built = PIPELINE_DP[case]
    pins = {"num_microbatches": 2, **pins}
    devices = 2 * pins["dp"]
    plan = _plan(graph, devices, pp=2, tp=1, microbatch_size=1, **pins)
    assert (plan.zero_stage, plan.schedule) == (pins["zero_stage"], pins["schedule"])
    losses, _, probed = run_ranks(source, plan, STEPS, probe=_wrapping_probe)
    assert losses == pytest.approx(reference, rel=1e-4)
    assert probed == built


def test_a_hand_edited_plan_the_runtime_cannot_honour_is_refused(gpt) -> None:
    """ZeRO-1 under tensor parallelism is not in the runtime's table: the search never
    proposes it, and a plan edited to ask for it is refused before any work."""
    from autopar.train import Trainer

    source, graph = gpt
    plan = _plan(graph, 4, dp=2, tp=2, zero_stage=2, microbatch_size=1)
    plan.zero_stage = 1
    with pytest.raises(autopar.PlanError, match="ZeRO-1 with tensor parallelism"):
        Trainer(source, plan, program=None, device="cpu")
    with pytest.raises(autopar.InfeasibleError):
        _plan(graph, 4, dp=2, tp=2, zero_stage=1, microbatch_size=1)


# four stages (zero-bubble: the most chunks a rank holds), and three chunks on each of two
# ranks; 1f1b over these chunks threads them as zero-bubble does
@pytest.mark.parametrize("pins", [dict(pp=4, schedule="zero_bubble", num_microbatches=4),
                                  dict(pp=2, schedule="interleaved", virtual_stages=3,
                                       num_microbatches=4)],
                         ids=["pp4-zero-bubble", "pp2-interleaved-v3"])
def test_hf_pipelines_deeper_than_two_chunks_match_single_process(llama, pins: dict) -> None:
    """A Hugging Face decoder hands its rotary tables and mask from before the first layer to
    every layer: split into more than two chunks, the later chunks would read them from the
    first (a skip connection torch's schedules refuse); the runtime threads them through."""
    source, graph = llama
    reference, _ = run_ranks(source, _plan(graph, 1, microbatch_size=1, num_microbatches=4),
                             STEPS)
    devices = pins["pp"]
    plan = _plan(graph, devices, tp=1, dp=1, microbatch_size=1, **pins)
    assert len(plan.stages) * plan.virtual_stages > 2
    losses, _ = run_ranks(source, plan, STEPS)
    assert losses == pytest.approx(reference, rel=1e-4)


def _gather_probe(trainer) -> dict:
    """This rank's wrapping (:func:`_wrapping_probe`), its fully_shard units, and how many
    all-gathers one more training step makes."""
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as param_group
    from torch.distributed.fsdp import FSDPModule

    gather = param_group.foreach_all_gather
    count = [0]

    def counting(*args, **kwargs):
        count[0] += 1
        return gather(*args, **kwargs)

    param_group.foreach_all_gather = counting
    try:
        trainer.train_step()
    finally:
        param_group.foreach_all_gather = gather
    units = sum(1 for m in trainer.model.modules() if isinstance(m, FSDPModule))
    return {**_wrapping_probe(trainer), "units": units, "gathers": count[0]}


def test_zero_bubble_with_zero3_equals_one_process(llama) -> None:
    """pp2 x dp2 zero-bubble with ZeRO-3, drawn from the search: fully_shard reshards every
    layer after its forward, and the split backward's weight step still fills every stage's
    gradients (autopar/parallel/split_backward.py): the losses and every first-step gradient
    equal one process's."""
    import numpy as np

    source, graph = llama
    plan = _plan(graph, 4, pp=2, dp=2, tp=1, zero_stage=3, schedule="zero_bubble",
                 microbatch_size=1)
    assert (plan.zero_stage, plan.schedule, plan.mesh["pp"], plan.mesh["dp"]) == \
        (3, "zero_bubble", 2, 2)
    single = _plan(graph, 1, microbatch_size=1, num_microbatches=4)
    reference, _, ref_grads = run_ranks(source, single, STEPS, first_grads=True)
    losses, _, grads, built = run_ranks(source, plan, STEPS, first_grads=True,
                                        probe=_gather_probe)
    assert built["reshard"] == [True]  # ZeRO-3: every layer resharded after its forward
    # what the cost model prices for fully_shard x ZeRO-3 under a pipeline schedule, as for
    # 1F1B: each unit gathered in the first forward and once per micro-batch's backward; the
    # gather before a weight-gradient step finds the stage gathered and sends nothing
    assert built["gathers"] == built["units"] * (1 + plan.num_microbatches), built
    assert losses == pytest.approx(reference, rel=1e-4, abs=1e-4)
    assert set(grads) == set(ref_grads)  # the second stage's too
    for name, g in ref_grads.items():
        assert np.linalg.norm(grads[name] - g) <= 1e-4 * max(np.linalg.norm(g), 1e-8), name
