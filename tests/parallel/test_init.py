"""Sharded weight initialisation: meta builds, per-module deterministic init, local shards only."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import autopar
from autopar.models import GPT, GPTConfig, build_model
from autopar.models.source import build_from_source, describe_source
from autopar.parallel.init import canonical_fqn, materialize, unit_seed

SEED = 7
GPT_CFG = GPTConfig(vocab_size=128, seq_len=32, d_model=64, n_layers=2, n_heads=4)


def make_gpt() -> GPT:
    """A ``module:factory`` for the meta-build test."""
    return GPT(GPT_CFG)


def _source(name: str) -> dict:
    return describe_source(GPT(GPT_CFG)) if name == "gpt" else describe_source(name)


def _materialized(source: dict, seed: int = SEED) -> nn.Module:
    model = build_from_source(source, seed, "meta")
    materialize(model, seed)
    return model


def _tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters(remove_duplicate=False)),
            **dict(model.named_buffers(remove_duplicate=False))}


@pytest.mark.parametrize("kind", ["class", "hf_config", "factory"])
def test_build_from_source_on_meta_allocates_nothing(kind: str) -> None:
    source = {"class": _source("gpt"), "hf_config": _source("tiny-llama"),
              "factory": {"kind": "factory", "spec": "tests.parallel.test_init:make_gpt"}}[kind]
    model = build_from_source(source, SEED, "meta")
    assert all(t.is_meta for t in _tensors(model).values())


@pytest.mark.parametrize("name", ["gpt", "tiny-llama", "tiny-mixtral", "tiny-gpt2"])
def test_materialize_is_deterministic_complete_and_seeded(name: str) -> None:
    source = _source(name)
    first, second = _materialized(source), _materialized(source)
    a, b = _tensors(first), _tensors(second)
    assert a.keys() == b.keys() and a
    for fqn, t in a.items():
        assert not t.is_meta and t.device.type == "cpu", fqn
        assert torch.isfinite(t).all(), fqn
        assert torch.equal(t, b[fqn]), fqn
    other = _tensors(_materialized(source, seed=SEED + 1))
    weights = [f for f, t in a.items() if t.dim() == 2]
    assert all(not torch.equal(a[f], other[f]) for f in weights)


def test_materialize_leaves_the_global_rng_alone() -> None:
    model = build_from_source(_source("gpt"), SEED, "meta")
    torch.manual_seed(3)
    before = torch.get_rng_state()
    materialize(model, SEED)
    assert torch.equal(torch.get_rng_state(), before)


def _std_ok(t: torch.Tensor, std: float) -> bool:
    t = t.detach()
    return abs(float(t.std()) - std) < 0.1 * std and abs(float(t.mean())) < 0.2 * std


def test_gpt_follows_its_init_rule_and_keeps_the_tie() -> None:
    model = _materialized(_source("gpt"))
    assert model.head.weight is model.tok_emb.weight  # tied: one tensor, initialised once
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            assert _std_ok(module.weight, 0.02), name
            if getattr(module, "bias", None) is not None:
                assert torch.all(module.bias == 0), name
        elif isinstance(module, nn.LayerNorm):
            assert torch.all(module.weight == 1) and torch.all(module.bias == 0), name
    # per-module seeds: equal shapes in different layers are different draws
    assert not torch.equal(model.layers[0].mlp.fc.weight, model.layers[1].mlp.fc.weight)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-mixtral"])
def test_hf_models_follow_their_init_rule(name: str) -> None:
    model = _materialized(_source(name))
    std = model.config.initializer_range
    checked = 0
    for fqn, p in model.named_parameters():
        if fqn.endswith("norm.weight"):
            assert torch.all(p == 1), fqn
        else:  # linears, the embedding, the router and the stacked (3-D) experts
            assert _std_ok(p, std), fqn
        checked += 1
    assert checked == len(list(model.parameters()))
    normal = build_model(name, device="cpu", dtype=torch.float32)
    for fqn, buf in normal.named_buffers():  # rotary inv_freq (non-persistent) and its copy
        assert torch.equal(dict(model.named_buffers())[fqn], buf), fqn
    assert any("inv_freq" in f for f, _ in normal.named_buffers())


def test_a_parent_rule_reaching_into_its_child_is_applied() -> None:
    """GPT-2's attention and MLP rescale their child c_proj (std 0.02 / sqrt(2 n_layer))."""
    model = _materialized(_source("tiny-gpt2"))
    h = model.transformer.h[0]
    assert _std_ok(h.attn.c_proj.weight, 0.02 / (2 * model.config.n_layer) ** 0.5)
    assert _std_ok(h.attn.c_attn.weight, 0.02)
    assert model.lm_head.weight is model.transformer.wte.weight


def test_canonical_fqn_strips_wrappers_so_wrapped_models_get_the_same_weights() -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    assert canonical_fqn("layers.0._checkpoint_wrapped_module.attn.qkv.weight") == \
        "layers.0.attn.qkv.weight"
    assert canonical_fqn("_orig_mod.layers.1._fsdp_wrapped_module.mlp") == "layers.1.mlp"
    assert unit_seed(0, "layers.0._checkpoint_wrapped_module.attn") == unit_seed(0, "layers.0.attn")
    source = _source("gpt")
    plain = _tensors(_materialized(source))
    model = build_from_source(source, SEED, "meta")
    reference = copy.deepcopy(model)
    model.layers[0] = checkpoint_wrapper(model.layers[0])
    materialize(model, SEED, reference=reference)
    for fqn, t in _tensors(model).items():
        assert torch.equal(t, plain[canonical_fqn(fqn)]), fqn


def test_a_pipeline_stage_gets_its_slice_of_the_same_weights() -> None:
    """A last stage: no embedding, and its own (untied) copy of the tied head weight."""
    source = _source("gpt")
    plain = _tensors(_materialized(source))
    stage = build_from_source(source, SEED, "meta")
    reference = copy.deepcopy(stage)
    stage.tok_emb, stage.pos_emb, stage.layers[0] = nn.Identity(), nn.Identity(), nn.Identity()
    stage.head.weight = nn.Parameter(torch.empty_like(stage.head.weight))
    report = materialize(stage, SEED, reference=reference)
    assert torch.equal(stage.head.weight, plain["tok_emb.weight"])
    for fqn, t in _tensors(stage).items():
        assert torch.equal(t, plain[fqn]), fqn
    assert report.units < 15  # the first stage's modules were never generated here


def test_stages_traced_from_a_meta_model_get_the_same_weights() -> None:
    """torch.distributed.pipelining traces the meta model; each stage module materializes
    alone (as its rank would) and the two stages compute what one process does."""
    from torch.distributed.pipelining import SplitPoint, pipeline

    source = _source("gpt")
    plain = _materialized(source)
    model = build_from_source(source, SEED, "meta")
    reference = copy.deepcopy(model)
    pipe = pipeline(model, mb_args=(torch.zeros(1, 32, dtype=torch.long),),
                    split_spec={"layers.1": SplitPoint.BEGINNING})
    stages = [pipe.get_stage_module(i) for i in range(pipe.num_stages)]
    expected = _tensors(plain)
    for stage in stages:
        materialize(stage, SEED, reference=reference)
        for fqn, t in _tensors(stage).items():
            assert torch.equal(t, expected[fqn]), fqn
    ids = torch.randint(0, GPT_CFG.vocab_size, (1, 32), generator=torch.Generator().manual_seed(1))
    assert torch.equal(stages[1](stages[0](ids)), plain(ids))


def test_hf_stages_traced_on_meta_run_on_the_real_device() -> None:
    """Tracing a transformers model on meta bakes device=meta into its stages' nested graphs
    (positional aten.to.device arguments, _assert_tensor_metadata keywords); after
    retarget_graph_devices and materialize the two stages compute what one process does."""
    from torch.distributed.pipelining import SplitPoint, pipeline

    from autopar.parallel.pipeline import retarget_graph_devices

    source = _source("tiny-llama")
    plain = _materialized(source)
    model = build_from_source(source, SEED, "meta")
    reference = copy.deepcopy(model)
    pipe = pipeline(model, mb_args=(torch.zeros(1, 32, dtype=torch.long),),
                    mb_kwargs={"use_cache": False},
                    split_spec={"model.layers.1": SplitPoint.BEGINNING})
    stages = [pipe.get_stage_module(i) for i in range(pipe.num_stages)]

    def baked(stage: nn.Module) -> int:
        return sum("device(type='meta')" in repr((n.args, n.kwargs)) for m in stage.modules()
                   if isinstance(getattr(m, "graph", None), torch.fx.Graph) for n in m.graph.nodes)

    assert baked(stages[0]) > 0
    for stage in stages:
        retarget_graph_devices(stage, torch.device("cpu"))
        assert baked(stage) == 0
        materialize(stage, SEED, reference=reference)
    ids = torch.randint(0, 100, (1, 32), generator=torch.Generator().manual_seed(1))
    first = stages[0](ids)
    out = stages[1](*(first if isinstance(first, tuple) else (first,)))
    out = out[0] if isinstance(out, tuple) else out
    assert torch.equal(out, plain(ids, use_cache=False).logits)


def test_bad_input_is_refused_with_the_fix() -> None:
    with pytest.raises(autopar.PlanError, match="device='meta'"):
        materialize(GPT(GPT_CFG), SEED)

    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.scale = nn.Parameter(torch.ones(4))  # no rule can rebuild this from meta

    with torch.device("meta"):
        odd = Scaled()
    with pytest.raises(autopar.PlanError, match="scale.*init_module"):
        materialize(odd, SEED)
    with pytest.raises(autopar.PlanError, match="unparallelised and on meta"):
        materialize(build_from_source(_source("gpt"), SEED, "meta"), SEED,
                    reference=GPT(GPT_CFG))
