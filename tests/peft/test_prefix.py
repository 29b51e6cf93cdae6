"""Prefix Tuning as a transform of the captured model: peft's parameter count and peft's
outputs for the same prefix, split by heads by the planner, and peft's adapter files both
ways."""

from __future__ import annotations

import pytest
import torch

import autopar
from autopar.models.hf import build_model
from autopar.peft import apply_peft
from autopar.peft.saved import adapter_files, load_adapter, save_adapter

PREFIX = "method=prefix_tuning,num_virtual_tokens=5"


def _trainable(model) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def _peft_prefix(name: str):
    from peft import PrefixTuningConfig, get_peft_model

    torch.manual_seed(0)
    base = build_model(name, device="cpu", dtype=torch.float32)
    state = {k: v.clone() for k, v in base.state_dict().items()}
    return get_peft_model(base, PrefixTuningConfig(task_type="CAUSAL_LM",
                                                   num_virtual_tokens=5)), state


# tiny Llama (grouped-query heads), Phi-3 (fused qkv) and GPT-2 (Conv1D, learned positions)
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-phi3", "tiny-gpt2"])
def test_prefix_tuning_is_peft_prefix_tuning(name: str, tmp_path) -> None:
    """Same trainable count as peft; with peft's prefix copied in (through the adapter folder
    autopar writes), the same logits; and peft's own saved adapter loads back."""
    theirs, state = _peft_prefix(name)
    ours = build_model(name, device="cpu", dtype=torch.float32)
    ours.load_state_dict(state)
    apply_peft(ours, PREFIX)
    assert _trainable(ours) == _trainable(theirs) > 0
    assert not any(p.requires_grad for n, p in ours.named_parameters() if "prefix" not in n)
    # peft's trained prefix -> its adapter folder -> autopar's model
    theirs.save_pretrained(tmp_path / "peft")
    fresh = build_model(name, device="cpu", dtype=torch.float32)
    fresh.load_state_dict(state)
    load_adapter(fresh, tmp_path / "peft")
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = theirs(input_ids=ids).logits
        torch.testing.assert_close(fresh(ids).logits, expected, rtol=0, atol=1e-6)
    # autopar's folder of the same prefix is peft's: peft loads it with the same logits
    from peft import PeftModel

    trained = {n: p.detach() for n, p in fresh.named_parameters() if p.requires_grad}
    (tmp_path / "ours").mkdir()
    save_adapter(tmp_path / "ours", *adapter_files(fresh, autopar.peft.parse_peft(PREFIX),
                                                   trained))
    base = build_model(name, device="cpu", dtype=torch.float32)
    base.load_state_dict(state)
    again = PeftModel.from_pretrained(base, tmp_path / "ours")
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=ids).logits, expected, rtol=0, atol=1e-6)


def test_the_planner_splits_prefixes_with_their_heads() -> None:
    """At full size under tp=8 the attention splits by heads, and so does each layer's
    prefix (Llama-3-8B: 8 kv heads); peft's count for 20 virtual tokens."""
    graph = autopar.capture("llama3-8b", seq=1024, peft="prefix_tuning")
    plan = autopar.plan(graph, devices=8, global_batch=8, memory_limit_gb=1e6, task="finetune",
                        constraints=dict(tp=8, pp=1, sequence_parallel=False))
    params = plan.placements["params"]
    assert params["model.layers.3.self_attn.prefix.prefix_key"] == "Shard(0)@tp"
    assert params["model.layers.3.self_attn.prefix.prefix_value"] == "Shard(0)@tp"
    assert params["model.layers.3.self_attn.q_proj.weight"] == "Shard(0)@tp"
    assert plan.trainable_params == 20 * 32 * 2 * 8 * 128


def test_bad_adapter_folders_are_refused(tmp_path) -> None:
    model = build_model("tiny-llama", device="meta")
    with pytest.raises(autopar.PlanError, match="is not an adapter folder"):
        load_adapter(model, tmp_path)
    other = build_model("tiny-gpt2", device="meta")
    apply_peft(other, PREFIX)
    trained = {n: torch.zeros(p.shape) for n, p in other.named_parameters() if p.requires_grad}
    save_adapter(tmp_path, *adapter_files(other, autopar.peft.parse_peft(PREFIX), trained))
    with pytest.raises(autopar.PlanError, match="load it onto the base model"):
        load_adapter(build_model("tiny-llama", device="cpu"), tmp_path)


def test_a_prefix_projection_is_refused(tmp_path) -> None:
    config = tmp_path / "adapter_config.json"
    config.write_text('{"peft_type": "PREFIX_TUNING", "num_virtual_tokens": 4, '
                      '"prefix_projection": true}')
    with pytest.raises(autopar.PlanError, match="prefix_projection"):
        autopar.peft.parse_peft(config)
    config.write_text(config.read_text().replace("true", "false"))
    assert autopar.peft.parse_peft(config).num_virtual_tokens == 4
