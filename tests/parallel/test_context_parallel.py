"""Context parallelism: the ring and all-to-all attention functions against whole-sequence
causal SDPA on 2 and 4 gloo processes, then training through plans from ``autopar.plan``
equal to one process."""

from __future__ import annotations

import pytest

from tests.fixtures.harness import record_first_grads, run_in_group, spawn_ranks

pytestmark = pytest.mark.dist


def _attention_rank(rank: int, port: int, out, world: int, mode: str, kv_heads: int) -> None:
    run_in_group(rank, port, out, world, _compare_attention, mode, kv_heads)


def _compare_attention(mode: str, kv_heads: int) -> dict[str, float]:
    """The largest difference, over every rank, between this cp attention's output and q/k/v
    gradients on the rank's share and whole-sequence causal SDPA's on the same share."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from autopar.parallel.alltoall_attention import alltoall_attention
    from autopar.parallel.cp_layout import shard_sequence
    from autopar.parallel.ring_attention import ring_attention

    cp, me = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(7)
    batch, heads, seq, dim = 2, 4, 64, 8
    q = torch.randn(batch, heads, seq, dim, generator=g, dtype=torch.float64).float()
    k = torch.randn(batch, kv_heads, seq, dim, generator=g, dtype=torch.float64).float()
    v = torch.randn(batch, kv_heads, seq, dim, generator=g, dtype=torch.float64).float()
    grad = torch.randn(batch, heads, seq, dim, generator=g, dtype=torch.float64).float()
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    F.scaled_dot_product_attention(*whole, is_causal=True,
                                   enable_gqa=kv_heads != heads).backward(grad)
    reference = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                               enable_gqa=kv_heads != heads)
    mine = [shard_sequence(t, me, cp, dim=2).clone().requires_grad_() for t in (q, k, v)]
    if mode == "hybrid":  # all-to-all inside pairs of ranks, a ring across the pairs
        from autopar.parallel.hybrid_attention import hybrid_attention, hybrid_groups

        inner, outer = hybrid_groups(dist.group.WORLD, 2)
        result = hybrid_attention(*mine, inner, outer)
    else:
        from autopar.parallel.allgather_attention import allgather_attention

        attend = {"ring": ring_attention, "alltoall": alltoall_attention,
                  "allgather": allgather_attention}[mode]
        result = attend(*mine, dist.group.WORLD)
    result.backward(shard_sequence(grad, me, cp, dim=2))
    diffs = {"out": (result - shard_sequence(reference, me, cp, dim=2)).abs().max()}
    for name, local, full in zip("qkv", mine, whole, strict=True):
        diffs["d" + name] = (local.grad - shard_sequence(full.grad, me, cp, dim=2)).abs().max()
    gathered = torch.stack(list(diffs.values())).detach()
    dist.all_reduce(gathered, op=dist.ReduceOp.MAX)
    return dict(zip(diffs, gathered.tolist(), strict=True))


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("mode,kv_heads", [("ring", 2), ("ring", 4), ("alltoall", 2),
                                           ("alltoall", 4), ("allgather", 2)])
def test_cp_attention_equals_whole_sequence_causal_sdpa(world: int, mode: str,
                                                        kv_heads: int) -> None:
    """Forward output and q/k/v gradients of each rank's load-balanced share within 1e-5 of
    causal SDPA over the whole sequence (grouped-query attention: 2 key/value heads for 4
    query heads; under all-to-all on 4 ranks they are replicated per query head)."""
    diffs = spawn_ranks(_attention_rank, world, (world, mode, kv_heads))[0]
    assert max(diffs.values()) < 1e-5, diffs


@pytest.mark.parametrize("kv_heads", [2, 4])
def test_hybrid_cp_attention_equals_whole_sequence_causal_sdpa(kv_heads: int) -> None:
    """cp=4 as two all-to-all pairs and a ring across them: forward and q/k/v gradients of
    each rank's share within 1e-5 of whole-sequence causal SDPA, as ring and all-to-all."""
    diffs = spawn_ranks(_attention_rank, 4, (4, "hybrid", kv_heads))[0]
    assert max(diffs.values()) < 1e-5, diffs


SEQ, BATCH, STEPS = 256, 2, 4


# autopar's own GPT (plain SDPA, learned positions), the other kind of model cp hooks
GPT_CFG = dict(vocab_size=128, seq_len=64, d_model=64, n_layers=2, n_heads=4)


def _build(kind: str):
    import torch

    from autopar.models import GPT, GPTConfig, build_model

    torch.manual_seed(0)  # every rank builds the same weights
    if kind == "gpt":
        return GPT(GPTConfig(**GPT_CFG))
    return build_model("tiny-llama", device="cpu", dtype=torch.float32)


def _llama_rank(rank: int, port: int, out, world: int, plan_dict: dict | None,
                kind: str = "llama") -> None:
    run_in_group(rank, port, out, world, _train_llama, world, plan_dict, kind)


def _train_llama(world: int, plan_dict: dict | None, kind: str) -> tuple[list[float], dict]:
    """(mean loss of each step, every parameter's gradient at the first optimizer step) of
    tiny Llama (GQA; or autopar's GPT) trained in your own loop: the plain model on one
    process, or the plan applied with autopar.parallelize, each cp rank feeding its share of
    each sequence."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import autopar
    from autopar.parallel.context_parallel import context_parallel_of
    from autopar.plan import Plan
    from autopar.train.loss import context_parallel_lm_loss, logits_of
    from autopar.train.parallelize import optimizer

    model = _build(kind)
    vocab, seq = (GPT_CFG["vocab_size"], GPT_CFG["seq_len"]) if kind == "gpt" else \
        (model.config.vocab_size, SEQ)
    plan = Plan.from_dict(plan_dict) if plan_dict else None
    if plan is not None:
        model = autopar.parallelize(model, plan)
    cp = context_parallel_of(model)
    assert (cp is not None) == (plan is not None)
    opt = optimizer(model, plan, lr=1e-3) if plan else \
        torch.optim.AdamW(model.parameters(), lr=1e-3)
    first = record_first_grads(model, opt)
    dp = plan.mesh["dp"] if plan else 1
    inner = plan.devices // dp if plan else 1  # ranks per data-parallel replica
    mine = dist.get_rank() // inner if plan else 0
    g = torch.Generator().manual_seed(3)
    losses = []
    for _ in range(STEPS):
        batch = torch.randint(0, vocab, (BATCH, seq + 1), generator=g)
        rows = batch[mine * BATCH // dp:(mine + 1) * BATCH // dp]
        ids, targets = rows[:, :-1], rows[:, 1:]
        if cp is None:
            loss = F.cross_entropy(logits_of(model(ids)).flatten(0, 1), targets.flatten())
            total = loss.detach()
        else:
            loss = context_parallel_lm_loss(cp, model(cp.shard(ids)), cp.shard(targets))
            total = cp.mean(loss)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if world > 1:  # every rank of a replica holds its mean: the mean over replicas
            dist.all_reduce(total)
            total = total / world
        losses.append(float(total))
    return losses, first


def _reference() -> tuple[list[float], dict]:
    return spawn_ranks(_llama_rank, 1, (1, None))[0]


def _assert_equal_to_one_process(got: tuple, reference: tuple) -> tuple[float, float]:
    """Assert losses and first-step gradients within 1e-4 of one process's; return the largest
    (loss, gradient) differences."""
    import numpy as np

    losses, grads = got
    ref_losses, ref_grads = reference
    assert losses == pytest.approx(ref_losses, abs=1e-4)
    assert len(set(losses)) == len(losses)  # every step changed the weights
    assert set(grads) == set(ref_grads)
    worst = max(float(np.abs(grads[n] - g).max()) for n, g in ref_grads.items())
    assert worst < 1e-4
    for name, g in ref_grads.items():  # relative too: a tiny gradient's error is tiny
        assert np.linalg.norm(grads[name] - g) <= 1e-4 * np.linalg.norm(g), name
    return max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)), worst


def _llama_plan(devices: int, cluster: str = "cpu", **pins):
    import autopar

    graph = autopar.capture("tiny-llama", seq=SEQ)
    constraints = dict(dp=1, tp=1, pp=1, ep=1, microbatch_size=BATCH // pins.get("dp", 1),
                       precision="fp32")
    return autopar.plan(graph, devices=devices, global_batch=BATCH, cluster=cluster,
                        constraints={**constraints, **pins})


@pytest.fixture(scope="module")
def reference() -> tuple[list[float], dict]:
    return _reference()


@pytest.mark.parametrize("pins", [dict(cp=2, cp_mode="ring"), dict(cp=2, cp_mode="alltoall"),
                                  dict(cp=4, cp_mode="ring"), dict(cp=4, cp_mode="hybrid"),
                                  dict(cp=4, cp_mode="alltoall"),
                                  dict(cp=2, cp_mode="allgather")],
                         ids=["cp2-ring", "cp2-alltoall", "cp4-ring", "cp4-hybrid",
                              "cp4-alltoall", "cp2-allgather"])
def test_parallelize_context_parallel_in_your_own_loop(pins: dict, reference) -> None:
    """Tiny Llama (4 query heads, 2 key/value heads) at 256 tokens, the plan drawn with cp
    pinned, applied by autopar.parallelize: losses over 4 steps and the first step's
    gradients equal one process's. (cp4 all-to-all: 2 key/value heads over 4 ranks, repeated
    per query head first, as the planner prices it.)"""
    plan = _llama_plan(pins["cp"], **pins)
    assert (plan.mesh["cp"], plan.cp_mode) == (pins["cp"], pins["cp_mode"])
    if plan.cp_mode == "hybrid":  # the "cpu" cluster's 2 devices per node: pairs, and a ring
        from autopar.codegen import program_text
        from autopar.models.source import describe_source

        text = program_text(plan, describe_source("tiny-llama"))
        assert "ap.context_parallel(model, mesh, plan.cp_mode, all_to_all_ranks=2)" in text
    got = spawn_ranks(_llama_rank, plan.devices, (plan.devices, plan.to_dict()))[0]
    print("max loss diff, max grad diff:", _assert_equal_to_one_process(got, reference))


def _compiled_run(plan, tmp_path, steps: int) -> tuple:
    """(losses, sharded count, first-step gradients, held-out loss) of the Trainer running
    the train.py that ``autopar.compile`` wrote for ``plan`` on ``plan.devices`` gloo
    processes."""
    import autopar
    from autopar.models.source import describe_source
    from tests.fixtures.harness import _worker

    out = autopar.compile("tiny-llama", None, plan, tmp_path / "art")
    program = (out / "train.py").read_text()
    assert '"cp"' in program.split("def build_mesh", 1)[1].split("def ", 1)[0]  # the cp axis,
    assert "ap.context_parallel(model, mesh, plan.cp_mode)" in program  # its attention ...
    assert f"context parallelism: cp={plan.mesh['cp']}" in program  # ... and a comment line
    source = describe_source("tiny-llama")
    return spawn_ranks(_worker, plan.devices,
                       (plan.devices, source, plan.to_dict(), steps, 0, None, False,
                        "synthetic", _held_out_loss, program, True, None))[0]


def _trainer_reference() -> tuple:
    from autopar.models.source import describe_source
    from tests.fixtures.harness import run_ranks

    return run_ranks(describe_source("tiny-llama"), _llama_plan(1), STEPS, first_grads=True,
                     probe=_held_out_loss)


def _held_out_loss(trainer) -> float:
    """The trained model's held-out loss (autopar run --eval synthetic), on every rank."""
    from autopar.train.evaluate import HeldOut, evaluate

    return evaluate(trainer, HeldOut(batches=1))["loss"]


@pytest.mark.parametrize("pins", [dict(cp=2, cp_mode="ring", recompute="selective"),
                                  dict(cp=2, tp=2, cp_mode="ring", zero_stage=2),
                                  dict(cp=2, dp=2, cp_mode="alltoall", zero_stage=3)],
                         ids=["cp2-ring-selective", "cp2xtp2-ring", "cp2xdp2-zero3-alltoall"])
def test_compiled_context_parallel_program_trains_as_one_process(pins: dict,
                                                                 tmp_path) -> None:
    """autopar compile's train.py for a plan drawn with cp pinned (and tp or ZeRO-3 data
    parallelism beside it), run by the Trainer: losses, first-step gradients and the
    held-out loss after training (evaluation splits the sequence too) equal one process's."""
    devices = pins["cp"] * pins.get("tp", 1) * pins.get("dp", 1)
    # on an A100 cluster the search splits the attention heads over tp (on "cpu" it keeps
    # them whole), so tp's per-rank attention runs the cp attention too
    plan = _llama_plan(devices, cluster="a100-80g", **pins)
    assert plan.mesh["cp"] == 2 and plan.mesh["tp"] == pins.get("tp", 1)
    # selective recompute re-runs the attention core, the ring's passes included (this hung
    # when the passes were replayed from the checkpoint's cache instead of sent)
    if "recompute" in pins:
        assert set(plan.recompute) == {pins["recompute"]}
    if plan.mesh["tp"] > 1:
        assert plan.placements["params"]["model.layers.0.self_attn.q_proj.weight"] != "Replicate"
    ref_losses, _, ref_grads, ref_held_out = _trainer_reference()
    losses, _, grads, held_out = _compiled_run(plan, tmp_path, STEPS)
    assert held_out == pytest.approx(ref_held_out, abs=1e-4)  # evaluation splits too
    assert losses == pytest.approx(ref_losses, abs=1e-4)
    print("max loss diff, max grad diff:",
          _assert_equal_to_one_process((losses, grads), (ref_losses, ref_grads)))


def test_layout_round_trips_and_pairs_early_with_late_chunks() -> None:
    import torch

    from autopar.parallel.cp_layout import (
        chunk_ids,
        global_positions,
        reshard_sequence,
        shard_sequence,
        unshard_sequence,
    )

    assert [chunk_ids(r, 4) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert global_positions(16, 1, 2).tolist() == [[4, 5, 6, 7, 8, 9, 10, 11]]
    x = torch.arange(24).view(1, 24)
    by_rank = torch.cat([shard_sequence(x, r, 3) for r in range(3)], dim=1)
    assert torch.equal(unshard_sequence(by_rank, 3, dim=1), x)
    assert torch.equal(reshard_sequence(x, 3, dim=1), by_rank)


def test_what_context_parallelism_refuses_says_why_in_one_line() -> None:
    """Experts, indivisible sequences and heads, an unknown mode, and models whose attention it
    cannot hook: each a one-line PlanError or reason (every mode the planner prices runs)."""
    from autopar.errors import PlanError
    from autopar.models import GPT, GPTConfig
    from autopar.parallel.alltoall_attention import alltoall_heads_refusal
    from autopar.parallel.context_parallel import apply_context_parallel
    from autopar.parallel.cp_layout import check_divisible
    from autopar.plan.support import context_parallel_refusal, unsupported_combination

    assert context_parallel_refusal("autopar", 2, "ring") is None
    assert context_parallel_refusal("autopar", 4, "alltoall") is None
    assert context_parallel_refusal("autopar", 4, "hybrid") is None  # run since this stop
    assert context_parallel_refusal("autopar", 2, "allgather") is None  # run since stop 41
    assert "cp_mode=zigzag" in context_parallel_refusal("autopar", 2, "zigzag")
    assert unsupported_combination(  # pp x cp runs since this stop
        engine="autopar", dp=1, tp=1, pp=2, ep=1, cp=2, zero_stage=0, sequence_parallel=False,
        offload=frozenset(), num_microbatches=2) is None
    assert context_parallel_refusal("megatron", 2, "hybrid") is None  # exported, not run
    assert "expert parallelism" in unsupported_combination(
        engine="autopar", dp=1, tp=1, pp=1, ep=2, cp=2, zero_stage=0, sequence_parallel=False,
        offload=frozenset())
    assert "ZeRO-0 with tensor parallelism" in unsupported_combination(
        engine="autopar", dp=1, tp=2, pp=1, ep=1, cp=2, zero_stage=0, sequence_parallel=False,
        offload=frozenset())
    assert "cp_mode=ring" in alltoall_heads_refusal(6, 2, 4)
    assert alltoall_heads_refusal(8, 2, 4) is None  # kv heads replicated per query head
    with pytest.raises(PlanError, match="divisible by 4"):
        check_divisible(250, 2)
    import torch

    with pytest.raises(PlanError, match="Hugging Face decoders"):
        apply_context_parallel(torch.nn.Linear(4, 4), None, "ring")
    unfused = GPT(GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=1, n_heads=2,
                            fused_attention=False))
    with pytest.raises(PlanError, match="fused_attention=True"):
        apply_context_parallel(unfused, None, "ring")
    with pytest.raises(PlanError, match="runs ring, alltoall, hybrid, allgather"):
        apply_context_parallel(unfused, None, "zigzag")


@pytest.mark.parametrize("mode", ["ring", "alltoall"])
def test_parallelize_context_parallel_on_a_plain_sdpa_gpt(mode: str) -> None:
    """autopar's GPT (its own F.scaled_dot_product_attention call, learned positions) under a
    cp2 plan drawn from autopar.plan, in your own loop: equal to one process."""
    import autopar
    from autopar.models import GPT, GPTConfig, token_inputs

    graph = autopar.capture(GPT(GPTConfig(**GPT_CFG)), token_inputs(1, GPT_CFG["seq_len"]))
    plan = autopar.plan(graph, devices=2, global_batch=BATCH, cluster="cpu",
                        constraints=dict(cp=2, cp_mode=mode, dp=1, tp=1, pp=1,
                                         microbatch_size=BATCH, precision="fp32"))
    assert plan.mesh["cp"] == 2
    reference = spawn_ranks(_llama_rank, 1, (1, None, "gpt"))[0]
    got = spawn_ranks(_llama_rank, 2, (2, plan.to_dict(), "gpt"))[0]
    print("max loss diff, max grad diff:", _assert_equal_to_one_process(got, reference))


def test_checkpoints_resume_across_cp_degrees(tmp_path) -> None:
    """A cp2 run's checkpoint resumes under cp4 (ZeRO-3 over dp x cp), whose checkpoint
    resumes on one process: the losses continue one process's (the parameters are whole on
    every cp rank; checkpoints do not depend on the sequence split)."""
    from autopar.models.source import describe_source
    from tests.fixtures.harness import run_ranks

    source, ckpt = describe_source("tiny-llama"), str(tmp_path / "ckpt")
    reference, _ = run_ranks(source, _llama_plan(1), steps=4)
    first, _ = run_ranks(source, _llama_plan(2, cp=2), steps=2, checkpoint_dir=ckpt)
    middle, _ = run_ranks(source, _llama_plan(4, cp=4, cp_mode="ring", zero_stage=3),
                          steps=1, checkpoint_dir=ckpt, resume=True)
    last, _ = run_ranks(source, _llama_plan(1), steps=1, checkpoint_dir=ckpt, resume=True)
    assert first + middle + last == pytest.approx(reference, abs=1e-4)


def test_a_cp2_checkpoint_loads_under_tp2_and_on_one_process(tmp_path) -> None:
    """The issue's case: a checkpoint written under cp2 resumes under tp2 (the parameters
    split by the tensor-parallel layout this time), whose checkpoint resumes on one process;
    the losses continue one process's."""
    from autopar.models.source import describe_source
    from tests.fixtures.harness import run_ranks

    source, ckpt = describe_source("tiny-llama"), str(tmp_path / "ckpt")
    reference, _ = run_ranks(source, _llama_plan(1), steps=4)
    first, _ = run_ranks(source, _llama_plan(2, cp=2, cp_mode="alltoall"), steps=2,
                         checkpoint_dir=ckpt)
    tp2 = _llama_plan(2, tp=2)
    assert tp2.mesh["tp"] == 2 and tp2.mesh["cp"] == 1
    middle, _ = run_ranks(source, tp2, steps=1, checkpoint_dir=ckpt, resume=True)
    last, _ = run_ranks(source, _llama_plan(1), steps=1, checkpoint_dir=ckpt, resume=True)
    assert first + middle + last == pytest.approx(reference, abs=1e-4)
