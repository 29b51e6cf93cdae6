"""Recompute mode ``op`` as the runtime runs it: torchtitan's op-level policy keeps what the
cost model says it keeps (bytes counted on a tiny Llama), and training under it gives the
numbers of training without recompute, on one process and on two."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy

import autopar
from autopar.cost.activations import block_activation_bytes
from autopar.cost.block_cost import captured_batch
from autopar.models import build_model
from autopar.models.source import describe_source
from autopar.parallel import policies as parallelize
from tests.fixtures.harness import run_ranks

SEQ, BATCH, STEPS = 32, 2, 3


@pytest.fixture(scope="module")
def llama():
    return describe_source("tiny-llama"), autopar.capture("tiny-llama", seq=SEQ)


def _storage_bytes(tensors) -> dict[int, int]:
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors
            if isinstance(t, torch.Tensor)}


def _priced(graph, mode: str) -> float:
    return block_activation_bytes(graph, graph.blocks[1], recompute=mode,
                                  scale=BATCH / captured_batch(graph)).stored_bytes


def test_op_policy_keeps_the_bytes_the_cost_model_prices(llama, monkeypatch) -> None:
    """Layer 0 wrapped by the runtime under ``op``: the outputs its policy marks MUST_SAVE in
    the forward, plus the layer's input the checkpoint holds, against the cost model."""
    _, graph = llama
    torch.manual_seed(0)
    model = build_model("tiny-llama", device="cpu")
    kept: dict[int, int] = {}
    runtime_policy = parallelize.op_level_policy

    def recording():
        policy = runtime_policy()

        def record(ctx, op, *args, **kwargs):
            decision = policy(ctx, op, *args, **kwargs)
            if decision is CheckpointPolicy.MUST_SAVE and not ctx.is_recompute:
                out = ctx.op_output
                kept.update(_storage_bytes(out if isinstance(out, (tuple, list)) else [out]))
            return decision

        return record

    monkeypatch.setattr(parallelize, "op_level_policy", recording)
    parallelize.recompute_block(model, "model.layers.0", "op", SEQ)
    inputs: dict = {}
    model.model.layers[0].register_forward_pre_hook(
        lambda m, args, kwargs: inputs.update(_storage_bytes([kwargs.get("hidden_states",
                                                                          *args[:1])])),
        with_kwargs=True)
    model(torch.randint(0, 100, (BATCH, SEQ))).logits.float().pow(2).mean().backward()
    measured = sum(kept.values()) + sum(inputs.values())
    assert len(kept) == 6  # q, v, gate, down projections; attention output and log-sum-exp
    assert measured == pytest.approx(_priced(graph, "op"), rel=0.03)


def test_no_recompute_saves_the_bytes_the_cost_model_prices(llama) -> None:
    """What autograd saves in layer 0 without recompute (saved_tensors_hooks; parameters
    left out), against the cost model's ``none``; ``full`` keeps the layer's input only."""
    _, graph = llama
    torch.manual_seed(0)
    model = build_model("tiny-llama", device="cpu")
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.update(_storage_bytes([t]))
        return t

    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
    layer = model.model.layers[0]
    layer.register_forward_pre_hook(lambda m, args: hooks.__enter__())
    layer.register_forward_hook(lambda m, args, out: hooks.__exit__(None, None, None))
    model(torch.randint(0, 100, (BATCH, SEQ))).logits.float().pow(2).mean().backward()
    measured = sum(b for ptr, b in saved.items() if ptr not in params)
    assert measured == pytest.approx(_priced(graph, "none"), rel=0.03)
    layer_input = BATCH * SEQ * model.config.hidden_size * 4  # fp32 hidden states
    assert _priced(graph, "full") == pytest.approx(layer_input)


def _plan(graph, devices: int, recompute: str, **pins):
    return autopar.plan(graph, devices=devices, global_batch=4, cluster="cpu",
                        constraints={"recompute": recompute, "precision": "fp32", **pins})


@pytest.mark.dist
def test_op_trains_as_without_recompute_on_one_process(llama) -> None:
    source, graph = llama
    runs = {}
    for mode in ("none", "op"):
        plan = _plan(graph, 1, mode, microbatch_size=2)
        assert set(plan.recompute[1:-1]) == {mode}
        runs[mode] = run_ranks(source, plan, STEPS, first_grads=True)
    (none_losses, _, none_grads), (op_losses, _, op_grads) = runs["none"], runs["op"]
    assert op_losses == pytest.approx(none_losses, rel=1e-5)
    assert none_losses[0] != none_losses[-1]  # it trains
    assert none_grads.keys() == op_grads.keys()
    for name, grad in none_grads.items():
        torch.testing.assert_close(op_grads[name], grad, rtol=1e-5, atol=1e-6)


@pytest.mark.dist
def test_op_plan_from_the_search_on_two_processes_matches_one(llama) -> None:
    source, graph = llama
    reference = run_ranks(source, _plan(graph, 1, "op", microbatch_size=2), STEPS)[0]
    plan = _plan(graph, 2, "op")  # the search draws the rest of the plan
    assert set(plan.recompute[1:-1]) == {"op"} and plan.devices == 2
    losses = run_ranks(source, plan, STEPS)[0]
    assert losses == pytest.approx(reference, rel=1e-4)


def test_op_on_a_mixture_of_experts_gives_the_gradients_of_no_recompute() -> None:
    """Mixtral's router normalises its top-k weights in place: were top-k's output kept, the
    recompute would replay the normalised weights and the router's gradient would be wrong
    (or PyTorch would refuse the mutated cache entry). The policy re-runs top-k."""
    torch.manual_seed(0)
    model = build_model("tiny-mixtral", device="cpu")
    ids = torch.randint(0, 100, (BATCH, SEQ))
    grads = {}
    for mode in ("none", "op"):
        run = copy.deepcopy(model)
        for i in range(len(run.model.layers)):
            parallelize.recompute_block(run, f"model.layers.{i}", mode, SEQ)
        run(ids).logits.float().pow(2).mean().backward()
        grads[mode] = {n.replace("._checkpoint_wrapped_module", ""): p.grad
                       for n, p in run.named_parameters() if p.grad is not None}
    assert grads["op"].keys() == grads["none"].keys()
    for name, grad in grads["none"].items():
        torch.testing.assert_close(grads["op"][name], grad, rtol=1e-5, atol=1e-6)
