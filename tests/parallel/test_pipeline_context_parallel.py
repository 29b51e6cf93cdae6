"""Context parallelism inside pipeline stages (pp x cp): the traced stages' attention nodes run
the cp attention, the first stage takes each rank's global positions. Plans drawn from the
search with pp and cp pinned, compiled by ``autopar.compile`` and run by the Trainer on gloo:
losses, first-step gradients and the held-out loss equal one process's."""

from __future__ import annotations

import pytest

from tests.parallel.test_context_parallel import (
    BATCH,
    GPT_CFG,
    STEPS,
    _assert_equal_to_one_process,
    _held_out_loss,
    _llama_plan,
    _trainer_reference,
)


def _run_program(model_source: dict, plan, tmp_path, model: str | None = None) -> tuple:
    """(losses, sharded count, first-step gradients, held-out loss) of the train.py that
    ``autopar.compile`` writes for ``plan``, on ``plan.devices`` gloo processes."""
    import autopar

    out = autopar.compile(model or "tiny-llama", None, plan, tmp_path / "art")
    program = (out / "train.py").read_text()
    stage = program.split("def parallelize_stage", 1)[1].split("\ndef ", 1)[0]
    assert "ap.context_parallel_stage(stage, original, mesh, plan.cp_mode)" in stage
    return _spawn(model_source, plan, program)


def _spawn(model_source: dict, plan, program: str) -> tuple:
    from tests.fixtures.harness import _worker, spawn_ranks

    return spawn_ranks(_worker, plan.devices,
                       (plan.devices, model_source, plan.to_dict(), STEPS, 0, None, False,
                        "synthetic", _held_out_loss, program, True, None))[0]


@pytest.mark.parametrize("mode", ["ring", "alltoall"])
def test_pp2_x_cp2_program_trains_as_one_process(mode: str, tmp_path) -> None:
    """Tiny Llama (GQA: 4 query heads, 2 key/value heads) at 256 tokens, causal, the plan
    drawn with pp=2 and cp=2 pinned (the schedule the search's): equal to one process."""
    from autopar.models.source import describe_source

    plan = _llama_plan(4, cp=2, pp=2, cp_mode=mode, microbatch_size=1)
    assert (plan.mesh["pp"], plan.mesh["cp"], plan.cp_mode) == (2, 2, mode)
    ref_losses, _, ref_grads, ref_held_out = _trainer_reference()
    losses, _, grads, held_out = _run_program(describe_source("tiny-llama"), plan, tmp_path)
    assert held_out == pytest.approx(ref_held_out, abs=1e-4)  # evaluation splits too
    print(plan.schedule, "max loss diff, max grad diff:",
          _assert_equal_to_one_process((losses, grads), (ref_losses, ref_grads)))


def test_pp2_x_cp2_on_a_plain_sdpa_gpt(tmp_path) -> None:
    """autopar's GPT (its own scaled_dot_product_attention call, learned positions: the
    positions feed an embedding, not rotary tables) under pp2 x cp2, ring: equal to one
    process."""
    import autopar
    from autopar.codegen import program_text
    from autopar.models import GPT, GPTConfig, token_inputs
    from autopar.models.source import describe_source

    model = GPT(GPTConfig(**{**GPT_CFG, "seq_len": 256, "n_layers": 4}))
    source = describe_source(model)
    graph = autopar.capture(model, token_inputs(1, 256))
    pins = dict(dp=1, tp=1, ep=1, microbatch_size=1, precision="fp32")

    def draw(devices: int, **more):
        return autopar.plan(graph, devices=devices, global_batch=BATCH, cluster="cpu",
                            constraints={**pins, **more})

    reference = _spawn(source, draw(1, pp=1), program_text(draw(1, pp=1), source))
    plan = draw(4, pp=2, cp=2, cp_mode="ring")
    assert (plan.mesh["pp"], plan.mesh["cp"]) == (2, 2)
    losses, _, grads, held_out = _spawn(source, plan, program_text(plan, source))
    assert held_out == pytest.approx(reference[3], abs=1e-4)
    # the head is tied to the embedding: the last stage holds its own copy, whose gradient
    # is the tied one (both copies' summed), as the embedding's
    head = grads.pop("head.weight")
    assert abs(head - reference[2]["tok_emb.weight"]).max() < 1e-4
    print("max loss diff, max grad diff:",
          _assert_equal_to_one_process((losses, grads), (reference[0], reference[2])))


def test_pp2_x_cp2_x_tp2_program_trains_as_one_process(tmp_path) -> None:
    """Tiny Llama on 8 ranks: pp2 x cp2 x tp2 as drawn on an A100 cluster (the heads split
    over tp, so each stage's attention nodes see DTensors sharded on heads, and the cp
    attention runs on the local heads): equal to one process."""
    from autopar.models.source import describe_source

    plan = _llama_plan(8, cluster="a100-80g", cp=2, pp=2, tp=2, cp_mode="ring",
                       microbatch_size=1)
    assert (plan.mesh["pp"], plan.mesh["cp"], plan.mesh["tp"]) == (2, 2, 2)
    assert plan.placements["params"]["model.layers.0.self_attn.q_proj.weight"] != "Replicate"
    ref_losses, _, ref_grads, ref_held_out = _trainer_reference()
    losses, _, grads, held_out = _run_program(describe_source("tiny-llama"), plan, tmp_path)
    assert held_out == pytest.approx(ref_held_out, abs=1e-4)
    print(plan.schedule, "max loss diff, max grad diff:",
          _assert_equal_to_one_process((losses, grads), (ref_losses, ref_grads)))
