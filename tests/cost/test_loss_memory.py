"""Memory as the published engines run: the loss's logits per engine, llm-foundry's FSDP1
engine, Megatron's vocabulary-parallel tied embedding, and what the capture keeps for dropout
and fused attention (Korthikanti et al. 2022, Table 2, without the terms a fused kernel and a
zero dropout remove)."""

from __future__ import annotations

from dataclasses import replace

import pytest

import autopar
from autopar.cost import ParallelConfig, estimate, load_cluster
from autopar.cost.activations import block_activation_bytes
from autopar.cost.block_cost import cached_block_cost, cached_block_traffic
from autopar.cost.engines import ENGINE_FEATURES, loss_bytes_per_logit
from autopar.cost.precision import Precision
from autopar.ir.graph import OpKind
from autopar.models import build_model, token_inputs
from autopar.plan.support import plan_unsupported

from ..cli.test_inspect import _assert_one_line_error, cli_here

BF16 = Precision("bf16", "bf16", "fp32")
SEQ = 64


@pytest.fixture(scope="module")
def tiny_llama():
    return autopar.capture("tiny-llama", seq=SEQ)


def _vocab(graph) -> int:
    out = graph.op(graph.outputs[0]).output_meta[0]
    return out.shape[-1]


def _eager_loss_peak_bytes_per_logit(tokens: int = 1024, vocab: int = 4096) -> float:
    """The most bytes live at once, per logit, while autopar's loss (bf16 logits, cast to fp32)
    runs forward and backward and the logits are released before the backward, from
    PyTorch's memory profiler on CPU (the small hidden states and weights left in)."""
    import torch
    import torch.nn.functional as F
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import MemoryProfileTimeline

    hidden = torch.randn(tokens, 64, dtype=torch.bfloat16, requires_grad=True)
    head = torch.randn(vocab, 64, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, vocab, (tokens,))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                 with_stack=True) as prof:
        logits = hidden @ head.t()
        loss = F.cross_entropy(logits.float(), targets, reduction="sum")
        del logits
        loss.backward()
    _, sizes = MemoryProfileTimeline(prof._memory_profile())._coalesce_timeline(
        torch.device("cpu"))
    return max(sum(s) for s in sizes) / (tokens * vocab)


def test_the_loss_holds_the_logits_as_each_engine_computes_it() -> None:
    # eager fp32 loss: log-softmax's saved output, the gradient it is handed and the one it
    # writes, all fp32 (measured); Megatron's vocab-parallel loss: the fp32 softmax written
    # over by its gradient, cast back; flash-attn's fused kernel: the logits and their
    # gradient, both in the compute dtype
    measured = _eager_loss_peak_bytes_per_logit()
    assert loss_bytes_per_logit("autopar", 2) == pytest.approx(measured, rel=0.05)
    assert loss_bytes_per_logit("llama3-4d", 2) == loss_bytes_per_logit("autopar", 2)
    for engine in ("megatron", "megatron-core", "deepspeed"):
        assert loss_bytes_per_logit(engine, 2) == 6
    assert loss_bytes_per_logit("llm-foundry", 2) == 4
    assert loss_bytes_per_logit("llm-foundry", 4) == 8  # an fp32 model keeps fp32 logits


@pytest.mark.parametrize("tp", [1, 2])
def test_a_fused_loss_keeps_less_than_autopars_eager_fp32_loss(tiny_llama, tp) -> None:
    """The same FSDP states on both engines: only the loss's buffers differ, by 8 bytes per
    logit on each rank's vocabulary shard."""
    cluster = load_cluster("h100-80g")
    mb = 4
    config = ParallelConfig(dp=2, tp=tp, zero_stage=3, microbatch_size=mb, precision=BF16)
    eager = estimate(tiny_llama, cluster, config).memory
    fused = estimate(tiny_llama, cluster, replace(config, engine="llm-foundry")).memory
    logits = mb * SEQ * _vocab(tiny_llama) / tp
    assert eager.buffers - fused.buffers == pytest.approx(8 * logits)
    assert (eager.params, eager.grads, eager.optimizer, eager.activations) == \
        (fused.params, fused.grads, fused.optimizer, fused.activations)


def test_llm_foundry_gathers_flat_parameters_without_fsdp2_copies(tiny_llama) -> None:
    cluster = load_cluster("a100-80g")
    config = ParallelConfig(dp=8, zero_stage=3, precision=BF16)
    fsdp2 = cached_block_traffic(tiny_llama, 1, config, cluster)
    fsdp1 = cached_block_traffic(tiny_llama, 1, replace(config, engine="llm-foundry"), cluster)
    assert fsdp2.gather_copy_s > 0 and fsdp2.reduce_copy_s > 0
    # no copy-out; the bf16 flat gradient cast to the fp32 reduce dtype, as FSDP2's copy-in
    assert fsdp1.gather_copy_s == 0
    assert fsdp1.reduce_copy_s == pytest.approx(fsdp2.reduce_copy_s)
    assert fsdp1.gather_s == pytest.approx(fsdp2.gather_s)
    pure = replace(config, engine="llm-foundry", precision=Precision("bf16", "bf16", "bf16"))
    assert cached_block_traffic(tiny_llama, 1, pure, cluster).reduce_copy_s == 0
    # Composer syncs every micro-batch under FSDP: ZeRO-2's traffic grows with them
    comm = {m: estimate(tiny_llama, cluster, ParallelConfig(
        dp=8, zero_stage=2, num_microbatches=m, precision=BF16,
        engine="llm-foundry")).stages[0].dp_comm_s for m in (1, 4)}
    assert comm[4] == pytest.approx(4 * comm[1])
    assert ENGINE_FEATURES["llm-foundry"].fp32_param_master


def test_llm_foundry_plans_no_pipeline_or_offload_and_is_not_run(tmp_path) -> None:
    graph = autopar.capture("tiny-llama", seq=32)
    plan = autopar.plan(graph, devices=8, global_batch=8, cluster="h100-80g",
                        constraints="engine=llm-foundry")
    assert plan.engine == "llm-foundry" and plan.mesh["pp"] == 1 and not plan.offload
    plan.mesh = {**plan.mesh, "pp": 2, "dp": plan.mesh["dp"] // 2}
    assert "pipeline parallelism on llm-foundry" in plan_unsupported(plan)
    plan.mesh = {**plan.mesh, "pp": 1, "dp": plan.mesh["dp"] * 2}
    plan.offload = ["optimizer"]
    assert "offload on llm-foundry" in plan_unsupported(plan)
    out = tmp_path / "art"
    made = cli_here("compile", "tiny-llama", "--devices", "8", "--seq", "32", "--global-batch",
                    "8", "--cluster", "h100-80g", "--constraints", "engine=llm-foundry",
                    "--out", str(out), "-q")
    assert made.returncode == 0, made.stderr
    assert not (out / "train.py").exists()
    _assert_one_line_error(cli_here("run", str(out), "--steps", "1"), "engine=llm-foundry",
                           "engine=autopar")


S, B, H, A = 256, 2, 256, 4


def _gpt2(dropout: float, layers: int = 2):
    config = {"model_type": "gpt2", "n_embd": H, "n_layer": layers, "n_head": A,
              "n_inner": 4 * H, "vocab_size": 512, "n_positions": S,
              "activation_function": "gelu_pytorch_tanh", "tie_word_embeddings": True,
              "dtype": "bfloat16", "attn_implementation": "sdpa", "resid_pdrop": dropout,
              "embd_pdrop": dropout, "attn_pdrop": dropout}
    return autopar.capture(build_model(config), token_inputs(B, S))


@pytest.fixture(scope="module")
def gpt2_no_dropout():
    return _gpt2(0.0)


@pytest.mark.parametrize("dropout,per_sbh", [(0.1, 34), (0.0, 32)])
def test_a_fused_gpt_layer_keeps_korthikantis_bytes_less_what_the_kernel_removes(
        gpt2_no_dropout, dropout, per_sbh) -> None:
    """Korthikanti's 34 s*b*h bytes (fp16, two 1-byte dropout masks outside attention) without
    the attention term a fused kernel never stores, and 32 without dropout (ATen's dropout
    returns its input at p = 0). The fused kernel's transposed output feeds the projection
    without a copy (no second s*b*h*2 bytes)."""
    graph = gpt2_no_dropout if dropout == 0 else _gpt2(dropout)
    block = graph.layer_blocks[0]
    stored = block_activation_bytes(graph, block).stored_bytes
    assert stored == pytest.approx(S * B * H * per_sbh, rel=0.03)
    kinds = {graph.op(n).kind for n in block.nodes if "dropout" in graph.op(n).target}
    assert kinds == ({OpKind.VIEW} if dropout == 0 else {OpKind.ELEMENTWISE})


def test_megatron_splits_a_tied_embedding_and_head_over_tp(gpt2_no_dropout) -> None:
    """Megatron's VocabParallelEmbedding and parallel_lm_logits share one vocabulary shard of
    the tied table; autopar's runtime keeps a tied table whole on every rank."""
    graph = gpt2_no_dropout
    cluster = load_cluster("a100-80g")
    config = ParallelConfig(tp=2, precision=BF16)
    head, tail = 0, len(graph.blocks) - 1
    whole = cached_block_cost(graph, head, config, cluster, "none")
    split = cached_block_cost(graph, head, replace(config, engine="megatron"), cluster, "none")
    table = graph.params["transformer.wte.weight"].numel
    assert whole.dense_params - split.dense_params == pytest.approx(table / 2)
    head_whole = cached_block_cost(graph, tail, config, cluster, "none")
    head_split = cached_block_cost(graph, tail, replace(config, engine="megatron"), cluster,
                                   "none")
    assert head_split.fwd_s + head_split.bwd_s < head_whole.fwd_s + head_whole.bwd_s
    assert head_split.tp_comm_s > head_whole.tp_comm_s  # the head's input gradient all-reduced
