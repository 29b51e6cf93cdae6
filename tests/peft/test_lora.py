"""LoRA and BitFit as transforms of the captured model: what trains matches Hugging Face peft,
and the planner prices what is frozen."""

from __future__ import annotations

import json

import pytest
import torch

import autopar
from autopar.cost.compute import op_backward_time
from autopar.cost.hardware import load_cluster
from autopar.ir.graph import OpKind
from autopar.models.hf import build_model
from autopar.peft import apply_peft, parse_peft
from autopar.search.api import model_graph

from ..cli.test_inspect import _assert_one_line_error, cli_here, run_cli


def _trainable(model) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("name,targets", [
    ("tiny-llama", None), ("tiny-llama", "all-linear"), ("tiny-llama", ["o_proj", "up_proj"]),
    ("tiny-llama", r".*\.(q|k)_proj"), ("tiny-phi3", ["qkv_proj"]), ("tiny-phi3", "all-linear")])
def test_lora_trains_what_peft_trains(name: str, targets) -> None:
    from peft import LoraConfig, get_peft_model

    ours = build_model(name, device="meta")
    apply_peft(ours, {"method": "lora", "r": 4, "lora_alpha": 8, "target_modules": targets})
    theirs = get_peft_model(build_model(name, device="meta"),
                            LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    assert _trainable(ours) == _trainable(theirs) > 0


def test_lora_starts_as_the_base_model_and_scales_like_peft() -> None:
    torch.manual_seed(0)
    base = build_model("tiny-llama", device="cpu")
    ids = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        before = base(ids).logits
        apply_peft(base, "method=lora,r=4,lora_alpha=16,use_rslora=true")
        assert torch.equal(base(ids).logits, before)  # B starts at zero
    q = base.model.layers[0].self_attn.q_proj
    assert q.scaling == 16 / 2  # rsLoRA: alpha / sqrt(r)
    assert not q.weight.requires_grad and q.lora_A.requires_grad and q.lora_B.requires_grad


def test_peft_settings_come_from_peft_files_names_and_pairs(tmp_path) -> None:
    from peft import LoraConfig

    LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, target_modules=["q_proj", "o_proj"]
               ).save_pretrained(tmp_path)
    config = parse_peft(tmp_path / "adapter_config.json")
    assert (config.method, config.r, config.lora_alpha, config.lora_dropout) == \
        ("lora", 16, 32, 0.05)
    assert sorted(config.target_modules) == ["o_proj", "q_proj"]
    assert parse_peft("bitfit").method == "bitfit"
    assert parse_peft("method=lora,r=2").r == 2
    for bad, cause in (("dora", "unknown fine-tuning method"), ("method=lora,rank=4",
                                                                 "unknown setting 'rank'"),
                       ("method=lora,r=0", "r must be a positive integer")):
        with pytest.raises(autopar.PlanError, match=cause):
            parse_peft(bad)


def test_bitfit_trains_only_biases_and_adds_them_where_missing() -> None:
    model = build_model("tiny-llama", device="meta")
    names = apply_peft(model, "bitfit")
    assert names and all(n.endswith(".bias") for n in names)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert sum(1 for m in linears if m.bias is not None) == len(linears) - 1  # not the head


def test_the_planner_prices_what_lora_freezes() -> None:
    full = autopar.plan("llama3-8b", devices=8, global_batch=64, seq=2048, task="finetune",
                        constraints={"tp": 8, "pp": 1})
    lora = autopar.plan("llama3-8b", devices=8, global_batch=64, seq=2048, task="finetune",
                        peft={"method": "lora", "r": 8, "target_modules": "all-linear"},
                        constraints={"tp": 8, "pp": 1})
    assert lora.trainable_params == 20_971_520  # peft's count for Llama-3-8B, r=8, all-linear
    assert full.trainable_params == full.model["params"] and not full.peft
    assert lora.peft["method"] == "lora"
    # no gradients or Adam states for the frozen base: a sliver of the full model's
    assert lora.predicted.memory["optimizer"] < full.predicted.memory["optimizer"] / 100
    assert lora.predicted.memory["grads"] < full.predicted.memory["grads"] / 100
    # frozen weights skip their weight gradients: every frozen base linear of the graph the
    # planner searched is priced with its input gradient only, the same op trained with both
    graph = model_graph("llama3-8b", None, "finetune", {}, 2048,
                        {"method": "lora", "r": 8, "target_modules": "all-linear"})
    frozen = [op for op in graph.ops_of_kind(OpKind.LINEAR)
              if op.params and not any(graph.params[p].trainable for p in op.params)]
    assert len(frozen) >= 7 * 32  # every projection of every layer
    device = load_cluster("a100-80g").device
    for op in frozen[:7]:
        only_input = op_backward_time(op, device, "bf16", 1.0, 1.0, 8, weight_grad=False)
        both = op_backward_time(op, device, "bf16", 1.0, 1.0, 8, weight_grad=True)
        assert only_input < 0.6 * both
    # the adapters follow their base linear: A replicated and B split on a column-parallel
    # linear, A split and B replicated on a row-parallel one
    params = lora.placements["params"]
    assert params == {**{k: v for k, v in params.items() if "lora" in k},
                      **full.placements["params"]}
    layer = "model.layers.3."
    assert params[layer + "self_attn.q_proj.weight"] == "Shard(0)@tp"
    assert (params[layer + "self_attn.q_proj.lora_A"],
            params[layer + "self_attn.q_proj.lora_B"]) == ("Replicate", "Shard(0)@tp")
    assert params[layer + "mlp.down_proj.weight"] == "Shard(1)@tp"
    assert (params[layer + "mlp.down_proj.lora_A"],
            params[layer + "mlp.down_proj.lora_B"]) == ("Shard(1)@tp", "Replicate")
    assert "lora r=8 on all-linear: 21 M" in lora.report()


def test_finetune_on_the_command_line(tmp_path) -> None:
    out = tmp_path / "ft"
    made = run_cli("compile", "tiny-llama", "--devices", "2", "--seq", "32", "--task",
                   "finetune", "--peft", "method=lora,r=4", "--out", str(out), "-q",
                   "--format", "json")
    assert made.returncode == 0, made.stderr
    plan = json.loads(made.stdout)
    assert plan["peft"]["r"] == 4 and plan["trainable_params"] == 4 * 4 * (64 + 64 + 64 + 32)
    _assert_one_line_error(run_cli("compile", "tiny-llama", "--devices", "2", "--peft", "lora",
                                   "--out", str(tmp_path / "a")), "--task finetune")
    _assert_one_line_error(cli_here("compile", "tiny-llama", "--devices", "2", "--task",
                                   "finetune", "--peft", "dora", "--out", str(tmp_path / "b")),
                           "unknown fine-tuning method", "lora")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_lora_and_full_fine_tuning_get_different_plans() -> None:
    """Llama-3-8B on 8 x a100-40g (bench/lora_vs_full.py prints the table): full fine-tuning
    only fits with its optimizer offloaded or activations recomputed, LoRA fits without, and
    the planner picks a different plan for each."""
    def plan(peft):
        return autopar.plan("llama3-8b", devices=8, cluster="a100-40g", global_batch=64,
                            seq=2048, task="finetune", peft=peft)

    full, lora = plan(None), plan("method=lora,r=8,lora_alpha=16,target_modules=all-linear")

    def shape(p):
        return (p.mesh, p.zero_stage, tuple(p.offload), tuple(p.recompute),
                p.microbatch_size)

    assert shape(full) != shape(lora)
    assert full.offload or set(full.recompute) != {"none"}
    assert lora.offload == [] and set(lora.recompute) == {"none"}
    # the frozen base is held in bf16 (no fp32 master): half the bytes per weight, summed over
    # the stages (which need not hold equal shares)
    held = sum(s["memory"]["params"] for s in lora.predicted.stages)
    assert held * (lora.mesh["dp"] if lora.zero_stage == 3 else 1) == pytest.approx(
        2 * 8.03e9, rel=0.01)
    def states(p):
        return p.predicted.memory["grads"] + p.predicted.memory["optimizer"]

    assert states(lora) < 0.02 * (full.predicted.memory["params"] + states(full))
    assert lora.predicted.step_time_s < full.predicted.step_time_s


def test_parallelize_applies_the_plans_method_once() -> None:
    """autopar.parallelize on a fine-tuning plan: the base model gets the planned method (only
    the adapters train); a model that has it already is left as it is; twice is refused."""
    graph = autopar.capture("tiny-llama", seq=16, peft="method=lora,r=2")
    plan = autopar.plan(graph, devices=1, global_batch=2, task="finetune")
    model = autopar.parallelize(build_model("tiny-llama", device="cpu"), plan)
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all(".lora_" in n for n in trained)
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == plan.trainable_params
    mine = build_model("tiny-llama", device="cpu")
    apply_peft(mine, "method=lora,r=2")
    assert autopar.parallelize(mine, plan) is not None
    with pytest.raises(autopar.PlanError, match="already fine-tuned with lora"):
        apply_peft(mine, "bitfit")
