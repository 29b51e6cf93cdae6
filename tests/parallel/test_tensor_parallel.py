"""Sequence parallelism and pipeline x tensor parallelism reproduce the single-process loss
trajectory (fp32, gloo, CPU), and the step really runs the collectives they promise."""

from __future__ import annotations

import os
from datetime import timedelta

import pytest

import autopar
from autopar.models import GPT, GPTConfig, token_inputs
from autopar.models.source import describe_source
from tests.fixtures.collectives import Collectives
from tests.fixtures.harness import run_ranks, spawn_ranks
from tests.fixtures.layouts import with_full_size_layout

from .test_equivalence import _plan

pytestmark = pytest.mark.dist
STEPS = 5


def _worker(rank: int, port: int, out, world: int, source: dict, plan_dict: dict) -> None:
    """Train STEPS steps, the last under a collective counter. Rank 0 reports its losses, the
    names of its sharded DTensor parameters, the step's collectives by kind, and the forward
    collectives per module."""
    import torch
    import torch.distributed as dist

    from autopar.codegen import generated_program
    from autopar.plan import Plan
    from autopar.train import Trainer

    torch.set_num_threads(1)
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=timedelta(seconds=60))
        plan = Plan.from_dict(plan_dict)
        trainer = Trainer(source, plan, program=generated_program(plan, source), device="cpu",
                          seed=0)
        losses = [trainer.train_step() for _ in range(STEPS - 1)]
        with Collectives(trainer.model) as counter:
            losses.append(trainer.train_step())
        total, per_module = counter.counts, counter.per_module
        sharded = sorted(n for n, p in trainer.model.named_parameters()
                         if hasattr(p, "device_mesh") and any(pl.is_shard() for pl in p.placements))
        dist.barrier()
        if rank == 0:
            out.put(("ok", (losses, sharded, total, per_module)))
    except Exception as exc:  # reported to the test as text, with where it happened
        import traceback

        where = "".join(traceback.format_exception(exc)[-4:])
        out.put(("error", f"rank {rank}: {type(exc).__name__}: {exc}\n{where}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _run(source: dict, plan, timeout_s: float = 300.0):
    """(losses, sharded parameter names, collectives of the last step by kind, forward
    collectives per module) of rank 0."""
    return spawn_ranks(_worker, plan.devices, (plan.devices, source, plan.to_dict()),
                       timeout_s)[0]


def _assert_sequence_parallel_layers(per_module: dict, layers: list[str]) -> None:
    """In each layer's forward the two row-parallel outputs reduce-scatter onto sequence
    shards and the attention/MLP inputs all-gather; nothing all-reduces."""
    found = 0
    for fqn, counts in per_module.items():
        if any(fqn.endswith("." + name) for name in layers):
            found += 1
            assert counts.get("all_reduce", 0) == 0, (fqn, counts)
            assert counts.get("reduce_scatter_tensor", 0) == 2, (fqn, counts)
            assert counts.get("all_gather_into_tensor", 0) == 2, (fqn, counts)
    assert found == len(layers)


@pytest.fixture(scope="module")
def gpt2():
    cfg = GPTConfig(vocab_size=128, seq_len=32, d_model=64, n_layers=2, n_heads=4)
    model = GPT(cfg)
    source, graph = describe_source(model), autopar.capture(model, token_inputs(1, 32))
    reference, _ = run_ranks(source, _plan(graph, 1, **ONE_MICROBATCH), STEPS)
    return source, graph, reference


@pytest.fixture(scope="module")
def gpt4():
    cfg = GPTConfig(vocab_size=128, seq_len=32, d_model=64, n_layers=4, n_heads=4)
    model = GPT(cfg)  # tied embedding and head: the stages' copies must sum their gradients
    source, graph = describe_source(model), autopar.capture(model, token_inputs(1, 32))
    reference, _ = run_ranks(source, _plan(graph, 1, **FOUR_MICROBATCHES), STEPS)
    return source, graph, reference


@pytest.fixture(scope="module")
def llama():
    source, graph = describe_source("tiny-llama"), autopar.capture("tiny-llama", seq=32)
    return source, graph, {}  # references by micro-batching, filled on first use


def _llama_reference(llama, batching: dict) -> list[float]:
    source, graph, cache = llama
    key = tuple(sorted(batching.items()))
    if key not in cache:
        cache[key] = run_ranks(source, _plan(graph, 1, **batching), STEPS)[0]
    return cache[key]


ONE_MICROBATCH = dict(microbatch_size=4, num_microbatches=1)
FOUR_MICROBATCHES = dict(microbatch_size=1, num_microbatches=4)


def test_gpt_tp2_sequence_parallel_matches_single_process(gpt2) -> None:
    source, graph, reference = gpt2
    plan = with_full_size_layout(_plan(graph, 2, tp=2, dp=1, sequence_parallel=True,
                                       **ONE_MICROBATCH), "gpt")
    assert plan.sequence_parallel
    losses, sharded, total, per_module = _run(source, plan)
    assert losses == pytest.approx(reference, rel=1e-4)
    assert losses[0] != losses[-1]  # it trains
    assert {"layers.0.attn.qkv.weight", "layers.1.mlp.proj.weight"} <= set(sharded)
    _assert_sequence_parallel_layers(per_module, ["layers.0", "layers.1"])
    # forward and backward: 2 reduce-scatters and 2 all-gathers per layer each way
    assert total["reduce_scatter_tensor"] >= 8 and total["all_gather_into_tensor"] >= 8


def test_tiny_llama_tp2_sequence_parallel_matches_single_process(llama) -> None:
    source, graph, _ = llama
    plan = with_full_size_layout(_plan(graph, 2, tp=2, dp=1, sequence_parallel=True,
                                       **ONE_MICROBATCH), "tiny-llama")
    losses, sharded, total, per_module = _run(source, plan)
    assert losses == pytest.approx(_llama_reference(llama, ONE_MICROBATCH), rel=1e-4)
    assert {"model.layers.0.self_attn.q_proj.weight", "model.embed_tokens.weight",
            "lm_head.weight"} <= set(sharded)
    _assert_sequence_parallel_layers(per_module, [f"model.layers.{i}" for i in range(4)])
    # the embedding reduce-scatters straight onto the sequence shards
    embed = next(c for f, c in per_module.items() if f.endswith("model.embed_tokens"))
    assert embed.get("reduce_scatter_tensor", 0) == 1


def _pp_tp_plan(graph):
    plan = _plan(graph, 4, pp=2, tp=2, dp=1, schedule="1f1b", sequence_parallel=False,
                 **FOUR_MICROBATCHES)
    assert plan.mesh == {"pp": 2, "dp": 1, "cp": 1, "ep": 1, "tp": 2}
    return plan


def _stage_names(names: list[str]) -> set[str]:
    """Parameter names inside the stage modules (the pipeline holds them as a ModuleList)."""
    return {n.split(".", 1)[1] for n in names}


def test_gpt_pp2_x_tp2_matches_single_process(gpt4) -> None:
    source, graph, reference = gpt4
    losses, sharded, total, _ = _run(source, with_full_size_layout(_pp_tp_plan(graph), "gpt"))
    assert losses == pytest.approx(reference, rel=1e-4)
    # rank 0 holds the first stage only (module "0" of its stage list), its layers split
    sharded = _stage_names(sharded)
    assert {"layers.0.attn.qkv.weight", "layers.1.mlp.proj.weight"} <= sharded
    assert not any(n.startswith(("layers.2", "layers.3")) for n in sharded)
    # per micro-batch and layer: 2 row-parallel all-reduces forward, 2 column ones backward
    assert total["all_reduce"] >= 4 * 2 * 4


def test_tiny_llama_pp2_x_tp2_matches_single_process(llama) -> None:
    source, graph, _ = llama
    plan = with_full_size_layout(_pp_tp_plan(graph), "tiny-llama")
    losses, sharded, total, _ = _run(source, plan)
    assert losses == pytest.approx(_llama_reference(llama, FOUR_MICROBATCHES), rel=1e-4)
    sharded = _stage_names(sharded)
    assert {"model.embed_tokens.weight", "model.layers.1.self_attn.k_proj.weight"} <= sharded
    assert not any(n.startswith("lm_head") for n in sharded)  # on the second stage
    assert total["all_reduce"] >= 4 * 2 * 4


def test_gpt_pp2_x_tp2_sequence_parallel_matches_single_process(gpt4) -> None:
    """Sequence parallelism inside pipeline stages (the planner proposes it): a stage's
    layers reduce-scatter onto sequence shards and all-gather them, instead of the
    row-parallel all-reduces; stages still exchange whole activations."""
    source, graph, reference = gpt4
    plan = _plan(graph, 4, pp=2, tp=2, dp=1, schedule="1f1b", sequence_parallel=True,
                 **FOUR_MICROBATCHES)
    assert plan.sequence_parallel and plan.mesh["pp"] == 2
    losses, sharded, total, _ = _run(source, plan)
    assert losses == pytest.approx(reference, rel=1e-4)
    assert {"layers.0.attn.qkv.weight", "layers.1.mlp.proj.weight"} <= _stage_names(sharded)
    # per micro-batch, in the forward alone: 2 reduce-scatters and 2 all-gathers per layer
    # (rank 0's stage holds 2 layers)
    assert total.get("reduce_scatter_tensor", 0) >= 4 * 2 * 2
    assert total.get("all_gather_into_tensor", 0) >= 4 * 2 * 2


def _lora_kv_rank(rank: int, port: int, out, world: int) -> None:
    from tests.fixtures.harness import run_in_group

    run_in_group(rank, port, out, world, _lora_kv_body, world)


def _lora_kv_body(world: int) -> dict:
    """A LoRA-adapted key projection (2 kv heads of 4 features) under KvHeadReplicated on
    ``world`` ranks: each rank's output rows and the weights' gradients, gathered."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.parallel.tp_styles import KvHeadReplicated
    from autopar.peft.lora import LoraLinear

    torch.manual_seed(0)
    proj = torch.nn.Linear(6, 8)
    LoraLinear.wrap(proj, r=2, scaling=0.5, dropout=0.0)
    torch.nn.init.normal_(proj.lora_B)  # B starts at zero: make the update count
    x = torch.randn(3, 6)
    if world == 1:
        y = proj(x)
        rows = {0: y.detach()}
    else:
        mesh = init_device_mesh("cpu", (world,))
        KvHeadReplicated(2, 4)._apply(proj, mesh)
        y = proj(x)
        mine = {dist.get_rank(): y.detach()}
        everyone = [None] * world
        dist.all_gather_object(everyone, mine)
        rows = {k: v for d in everyone for k, v in d.items()}
    y.pow(2).sum().backward()
    return {"out": torch.cat([rows[r] for r in sorted(rows)], dim=-1).numpy(),
            **{n: p.grad.numpy() for n, p in proj.named_parameters() if p.grad is not None}}


def test_kv_head_replication_keeps_a_lora_update() -> None:
    """Rank r computes kv head r; with LoRA on the projection its update is part of that head
    (B's rows, A whole), and every gradient equals one process's (summed over the ranks)."""
    import numpy as np

    from tests.fixtures.harness import spawn_ranks

    single = spawn_ranks(_lora_kv_rank, 1, (1,))[0]
    assert set(single) == {"out", "lora_A", "lora_B"}
    split = spawn_ranks(_lora_kv_rank, 2, (2,))[0]
    for key, value in single.items():
        np.testing.assert_allclose(split[key], value, rtol=1e-5, atol=1e-6,
                                   err_msg=key)


def test_sequence_parallel_refuses_a_split_region_holding_a_whole_module() -> None:
    """Tiny DeepSeek-V2 under tp2 with sequence parallelism: its MLA attention splits by heads
    but keeps the latent down-projection whole, and its MoE block splits the shared expert but
    keeps the router and experts whole; neither whole module can take the gathered sequence.
    The layout refuses in one line naming the module and the fix (without sp it runs:
    tests/train/test_router_loss.py)."""
    from autopar.models import build_model
    from autopar.parallel.tensor_parallel import tensor_parallel_layout

    graph = autopar.capture("tiny-deepseek-v2", seq=32)
    plan = autopar.plan(graph, devices=2, global_batch=4, cluster="a100-80g",
                        constraints=dict(tp=2, dp=1, ep=1, pp=1, cp=1, microbatch_size=1,
                                         sequence_parallel=True, precision="fp32"))
    model = build_model("tiny-deepseek-v2", device="meta")
    with pytest.raises(autopar.PlanError, match=r"keeps model\.layers\.\d\.(mlp\.\w+|self_attn\."
                                                r"kv_a_proj_with_mqa) whole.*"
                                                r"sequence_parallel=false"):
        tensor_parallel_layout(model, plan)
