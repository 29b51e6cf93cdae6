"""The activation model against what autograd keeps: a decoder layer's saved tensors, counted
with ``saved_tensors_hooks`` while the layers run on CPU, equal the cost model's layer bytes,
both for a model held in bf16 and for autopar's runtime (fp32 parameters under bf16 autocast,
:mod:`autopar.cost.autocast_dtypes`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import autopar
from autopar.cost.activations import block_activation_bytes
from autopar.cost.block_cost import autocast_compute, captured_float_bytes
from autopar.cost.config import ParallelConfig
from autopar.cost.precision import Precision
from autopar.train.autocast_ops import register_grouped_mm_autocast

CONFIGS = Path(autopar.__file__).parent / "models" / "configs"
BATCH, SEQ = 2, 128
# a Qwen3-MoE (per-head q/k norms, 16 experts, top 4) and a Llama, small, stored in bf16 as the
# published checkpoints are (so the capture carries their explicit fp32 upcasts)
MODELS = {
    "qwen3-moe": {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"],
                  "vocab_size": 512, "hidden_size": 128, "intermediate_size": 256,
                  "moe_intermediate_size": 64, "num_experts": 16, "num_experts_per_tok": 4,
                  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                  "head_dim": 32, "max_position_embeddings": 512, "norm_topk_prob": True,
                  "decoder_sparse_step": 1, "mlp_only_layers": [], "rms_norm_eps": 1e-6,
                  "tie_word_embeddings": False, "dtype": "bfloat16"},
    "llama": {**json.loads((CONFIGS / "tiny-llama.json").read_text()), "dtype": "bfloat16"},
}


def _saved_layer_bytes(model, autocast: bool) -> int:
    """Bytes of the distinct storages autograd saves inside the decoder layers (parameters
    and copies of them left out: the memory model counts those with the parameters)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    casts = ("ToCopyBackward0", "TransposeBackward0", "TBackward0", "ViewBackward0")

    def of_parameter(t: torch.Tensor) -> bool:
        fn = t.grad_fn
        for _ in range(3):
            if fn is None or type(fn).__name__ not in casts:
                return type(fn).__name__ == "AccumulateGrad"
            nxt = [f for f, _ in fn.next_functions if f is not None]
            if len(nxt) != 1:
                return False
            fn = nxt[0]
        return False

    saved: dict[int, int] = {}
    inside = [False]

    def pack(t):
        if inside[0] and t.untyped_storage().data_ptr() not in params and not of_parameter(t):
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    for layer in model.model.layers:
        layer.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True))
        layer.register_forward_hook(lambda *_: inside.__setitem__(0, False))
    ids = torch.randint(0, model.config.vocab_size, (BATCH, SEQ))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        model(input_ids=ids, labels=ids)
    return sum(saved.values())


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("runtime", ["bf16 parameters", "fp32 parameters under autocast"])
def test_layer_activations_equal_what_autograd_saves(name, runtime, tmp_path) -> None:
    import transformers

    (tmp_path / "config.json").write_text(json.dumps(MODELS[name]))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.from_pretrained(tmp_path))
    autocast = runtime.startswith("fp32")
    if autocast:
        register_grouped_mm_autocast("cpu")  # as autopar's Trainer does
    model = model.float() if autocast else model.to(torch.bfloat16)
    measured = _saved_layer_bytes(model, autocast)
    graph = autopar.capture(tmp_path, batch=BATCH, seq=SEQ)
    layers = [b for b in graph.blocks if b.role == "layer"]
    if autocast:
        modelled = sum(block_activation_bytes(graph, b, autocast="bf16").stored_bytes
                       for b in layers)
    else:
        scale = 2 / captured_float_bytes(graph)
        modelled = sum(block_activation_bytes(graph, b, scale=scale).stored_bytes
                       for b in layers)
    print(name, runtime, measured, modelled)
    assert modelled == pytest.approx(measured, rel=0.05)


@pytest.mark.parametrize("config, expected", [
    (dict(), "bf16"),  # one device: fp32 parameters under autocast
    (dict(dp=4, zero_stage=1), "bf16"),  # DDP
    (dict(tp=2), "bf16"),  # DTensor replicas of fp32 parameters
    (dict(dp=4, zero_stage=3), None),  # fully_shard gathers bf16 parameters
    (dict(ep=2, zero_stage=1), "bf16"),  # experts under DDP
    (dict(ep=2, zero_stage=1, tp=2), None),  # experts under fully_shard
    (dict(offload=("optimizer",)), None),  # FSDP2's offload
    (dict(engine="megatron"), None),  # bf16 parameters
    (dict(dp=4, zero_stage=3, precision=Precision("fp32", "bf16", "fp32")), "bf16"),
    (dict(precision=Precision("fp32", "fp32", "fp32")), None),
])
def test_the_runtime_keeps_an_fp32_residual_stream_where_it_holds_fp32_parameters(
        config, expected) -> None:
    config = ParallelConfig(**{"precision": Precision("bf16", "bf16", "fp32"), **config})
    assert autocast_compute(config) == expected
