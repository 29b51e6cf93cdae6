"""A mixture of experts' router losses: Hugging Face's load-balancing loss to 1e-6, the
z-loss from its definition, and training with them under plans drawn from the search equal to
one process (losses with the router terms included, first-step gradients)."""

from __future__ import annotations

import pytest
import torch
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

import autopar
from autopar.errors import PlanError
from autopar.models.source import build_from_source, describe_source
from autopar.train.router_loss import load_summary, router_loss_of, router_terms
from tests.fixtures.harness import differing_gradients, last_record, run_ranks
from tests.fixtures.layouts import with_full_size_layout
from tests.fixtures.moe import SEQ, mixtral_one_process, mixtral_plan

MOE = ["tiny-mixtral", "tiny-qwen2-moe"]
STEPS = 3


def _model_and_output(name: str):
    model = build_from_source(describe_source(name), 0, "cpu")
    ids = torch.randint(0, model.config.vocab_size, (2, SEQ), generator=torch.Generator()
                        .manual_seed(1))
    return model, model(ids, output_router_logits=True)


@pytest.mark.parametrize("name", MOE)
def test_aux_loss_equals_hugging_faces(name: str) -> None:
    model, output = _model_and_output(name)
    spec = router_loss_of(model, aux_coef=0.02)
    terms = router_terms(output.router_logits, spec)
    assert output.aux_loss is not None and float(output.aux_loss.detach()) > 0
    assert abs(float(terms.aux.detach()) - float(output.aux_loss.detach())) < 1e-6
    # and its gradient: the router weights' from ours and from Hugging Face's loss
    routers = [p for n, p in model.named_parameters() if n.endswith("mlp.gate.weight")]
    assert len(routers) == model.config.num_hidden_layers
    ours = torch.autograd.grad(terms.aux, routers, retain_graph=True)
    theirs = torch.autograd.grad(output.aux_loss, routers)
    for a, b in zip(ours, theirs, strict=True):
        assert torch.allclose(a, b, atol=1e-7, rtol=1e-5)
    # every top-k assignment is counted once: tokens x layers x k
    assert int(terms.load.sum()) == 2 * SEQ * model.config.num_hidden_layers * spec.top_k


def test_a_split_beside_a_whole_module_is_refused_inside_pipeline_stages() -> None:
    """DeepSeek-V2-Lite's layout (MLA split by heads beside its whole down-projection) copied
    onto a pp2 x tp2 plan: traced stages cannot run it, so the layout is refused in one line
    naming the module and the way out."""
    from autopar.models import build_model
    from autopar.parallel.tensor_parallel import tensor_parallel_layout

    plan = with_full_size_layout(_deepseek_plan(4, pp=2, tp=2, dp=1, ep=1, cp=1,
                                                sequence_parallel=False), "tiny-deepseek-v2")
    model = build_model("tiny-deepseek-v2", device="meta")
    with pytest.raises(PlanError, match=r"keeps model\.layers\.\d\.\w+\.\w+ whole.*pp=1") as info:
        tensor_parallel_layout(model, plan, traced=True)
    assert "\n" not in str(info.value)


def test_aux_loss_of_deepseek_v2_equals_hugging_faces_function() -> None:
    """DeepSeek-V2 (MLA, shared experts, a dense first layer): Hugging Face's model returns its
    router logits but computes no auxiliary loss, so the term is checked against Hugging
    Face's own load-balancing function on those logits, with its gradients."""
    model, output = _model_and_output("tiny-deepseek-v2")
    spec = router_loss_of(model, aux_coef=0.02)
    moe_layers = model.config.num_hidden_layers - model.config.first_k_dense_replace
    assert len(output.router_logits) == moe_layers
    terms = router_terms(output.router_logits, spec)
    theirs = load_balancing_loss_func(output.router_logits, spec.experts, spec.top_k)
    assert abs(float(terms.aux.detach()) - float(theirs.detach())) < 1e-6
    routers = [p for n, p in model.named_parameters() if n.endswith("mlp.gate.weight")]
    assert len(routers) == moe_layers
    for a, b in zip(torch.autograd.grad(terms.aux, routers, retain_graph=True),
                    torch.autograd.grad(theirs, routers), strict=True):
        assert torch.allclose(a, b, atol=1e-7, rtol=1e-5)


def test_z_loss_is_the_mean_squared_logsumexp_per_layer_summed() -> None:
    model, output = _model_and_output("tiny-mixtral")
    spec = router_loss_of(model, aux_coef=0.0, z_coef=1e-3)
    assert spec is not None and spec.aux_coef == 0
    expected = sum(float(torch.logsumexp(layer.float(), -1).square().mean())
                   for layer in output.router_logits)
    assert float(router_terms(output.router_logits, spec).z) == pytest.approx(expected,
                                                                               rel=1e-6)


def test_the_config_decides_unless_overridden() -> None:
    model = build_from_source(describe_source("tiny-mixtral"), 0, "meta")
    assert router_loss_of(model) is None  # output_router_logits is off, as Hugging Face's
    model.config.output_router_logits = True
    assert router_loss_of(model).aux_coef == model.config.router_aux_loss_coef
    assert router_loss_of(model, aux_coef=0.0) is None
    dense = build_from_source(describe_source("tiny-llama"), 0, "meta")
    assert router_loss_of(dense) is None
    with pytest.raises(PlanError, match="no top-k expert router"):
        router_loss_of(dense, aux_coef=0.01)
    with pytest.raises(PlanError, match="0 or more"):
        router_loss_of(model, aux_coef=-1.0)


def test_load_summary_against_an_even_share() -> None:
    assert load_summary(torch.tensor([2.0, 2.0, 2.0, 2.0])) == {"expert_load_max": 1.0,
                                                                "expert_load_min": 1.0}
    assert load_summary(torch.tensor([6.0, 2.0, 0.0, 0.0])) == {"expert_load_max": 3.0,
                                                                "expert_load_min": 0.0}


# ---- training: plans drawn from the search, 2 gloo processes, against one process ----------

HYPER = dict(router_aux_coef=0.5, router_z_coef=0.01)  # large: a wrong term shows


@pytest.fixture(scope="module")
def one_process() -> tuple:
    return mixtral_one_process(STEPS, HYPER)


@pytest.mark.dist
@pytest.mark.parametrize("pins", [dict(cp=2, dp=1, tp=1, ep=1, pp=1),
                                  dict(dp=2, tp=1, ep=1, pp=1, cp=1, zero_stage=1),
                                  dict(ep=4, dp=1, tp=1, pp=1, cp=1),
                                  dict(tp=2, dp=1, ep=1, pp=1, cp=1, sequence_parallel=True)],
                         ids=["cp2", "dp2-zero1", "ep4", "tp2-sp"])
def test_router_losses_under_drawn_plans_equal_one_process(pins: dict, one_process) -> None:
    plain, (ref_losses, _, ref_grads, ref_record) = one_process
    # the router terms are in the loss: without them it is another number
    assert abs(ref_losses[0] - plain[0]) > 1e-3
    assert ref_record["router_aux_loss"] > 0 and ref_record["expert_load_max"] >= 1.0
    devices = pins["cp"] * pins["dp"] * pins["tp"] * pins["ep"] * pins["pp"]
    plan = mixtral_plan(devices, microbatch_size=1, **pins)
    for axis, degree in pins.items():
        if axis in plan.mesh:
            assert plan.mesh[axis] == degree
    losses, _, grads, record = run_ranks(describe_source("tiny-mixtral"), plan, STEPS,
                                         first_grads=True, hyper=HYPER, probe=last_record)
    assert losses == pytest.approx(ref_losses, abs=1e-4)
    assert record["router_aux_loss"] == pytest.approx(ref_record["router_aux_loss"],
                                                      abs=1e-4)
    assert not differing_gradients(ref_grads, grads)


@pytest.mark.dist
def test_router_losses_across_pipeline_stages_with_experts_equal_one_process(one_process
                                                                            ) -> None:
    """ep2 x pp2 (4 processes), drawn by the search: the last stage computes the terms from
    every MoE layer's router logits, relayed from the stages that hold them; the losses
    (router terms included), the logged load-balancing term and every first-step gradient
    equal one process's."""
    _, (ref_losses, _, ref_grads, ref_record) = one_process
    plan = mixtral_plan(4, pp=2, ep=2, dp=1, tp=1, cp=1, microbatch_size=1, zero_stage=0)
    assert (plan.mesh["pp"], plan.mesh["ep"], plan.zero_stage) == (2, 2, 0)
    losses, _, grads, record = run_ranks(describe_source("tiny-mixtral"), plan, STEPS,
                                         first_grads=True, hyper=HYPER, probe=last_record,
                                         timeout_s=400)
    assert losses == pytest.approx(ref_losses, abs=1e-4)
    assert record["router_aux_loss"] == pytest.approx(ref_record["router_aux_loss"],
                                                      abs=1e-4)
    assert record["expert_load_max"] == pytest.approx(ref_record["expert_load_max"])
    assert not differing_gradients(ref_grads, grads)


def _deepseek_plan(devices: int, **pins):
    graph = autopar.capture("tiny-deepseek-v2", seq=SEQ)
    return autopar.plan(graph, devices=devices, global_batch=4, cluster="a100-80g",
                        constraints=dict(pins, precision="fp32", microbatch_size=1))


@pytest.fixture(scope="module")
def deepseek_one_process() -> tuple:
    return run_ranks(describe_source("tiny-deepseek-v2"), _deepseek_plan(1), STEPS,
                     first_grads=True, hyper=HYPER, probe=last_record)


@pytest.mark.dist
@pytest.mark.parametrize("pins", [dict(pp=2, ep=2, tp=1), dict(tp=2, ep=2, pp=1,
                                                                sequence_parallel=False),
                                  dict(pp=2, tp=2, ep=1, sequence_parallel=False)],
                         ids=["pp2 x ep2", "tp2 x ep2", "pp2 x tp2"])
def test_deepseek_v2_with_router_losses_equals_one_process(pins: dict,
                                                           deepseek_one_process) -> None:
    """Tiny DeepSeek-V2 (MLA attention, a shared expert, a dense first layer) under plans drawn
    by the search: pp2 x ep2 (Hugging Face collects its router logits with a hook, so they leave
    the stages as model outputs and are relayed to the last one), pp2 x tp2 (traced stages: the
    regions holding a whole module stay whole) and tp2 x ep2 with the layout
    the planner chooses for DeepSeek-V2-Lite (MLA split by heads: q and kv_b column-parallel,
    o_proj row-parallel, the latent down-projection whole and its shared rotary key's gradient
    summed over tp; the dense and shared-expert MLPs split). Losses with the router terms, the
    logged term and every first-step gradient equal one process's."""
    ref_losses, _, ref_grads, ref_record = deepseek_one_process
    parallel = _deepseek_plan(4, dp=1, cp=1, **pins)
    assert all(parallel.mesh[a] == pins[a] for a in ("pp", "ep", "tp"))
    if pins["tp"] > 1 and pins["pp"] > 1:
        # traced stages: the search keeps regions with a whole module whole (MLA's attention,
        # the MoE block with its shared expert) and splits the dense first layer's MLP
        params = parallel.placements["params"]
        assert params["model.layers.0.mlp.gate_proj.weight"] == "Shard(0)@tp"
        assert params["model.layers.1.mlp.shared_experts.gate_proj.weight"] == "Replicate"
        assert params["model.layers.1.self_attn.kv_b_proj.weight"] == "Replicate"
    elif pins["tp"] > 1:
        parallel = with_full_size_layout(parallel, "tiny-deepseek-v2")
        params = parallel.placements["params"]
        attention = "model.layers.1.self_attn."
        assert [params[attention + m + ".weight"] for m in
                ("q_proj", "kv_b_proj", "o_proj", "kv_a_proj_with_mqa")] == \
            ["Shard(0)@tp", "Shard(0)@tp", "Shard(1)@tp", "Replicate"]
    losses, _, grads, record = run_ranks(describe_source("tiny-deepseek-v2"), parallel, STEPS,
                                         first_grads=True, hyper=HYPER, probe=last_record,
                                         timeout_s=400)
    assert losses == pytest.approx(ref_losses, abs=1e-4)
    assert record["router_aux_loss"] == pytest.approx(ref_record["router_aux_loss"], abs=1e-4)
    assert any(".mlp.gate." in name for name in grads)
    assert not differing_gradients(ref_grads, grads)
