"""Memory terms against published formulas: ZeRO model states and Korthikanti activations."""

from __future__ import annotations

import pytest
import torch

import autopar
from autopar.cost.activations import block_activation_bytes
from autopar.cost.memory import inflight_microbatches, model_state_bytes
from autopar.models import GPT, GPTConfig, token_inputs


@pytest.mark.parametrize("stage,expected_gb", [(0, 120), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_paper_worked_example(stage: int, expected_gb: float) -> None:
    # Rajbhandari et al. (SC20): 7.5B parameters, 64 data-parallel devices, K = 12
    states = model_state_bytes(7.5e9, 64, stage)
    assert states.total / 1e9 == pytest.approx(expected_gb, abs=0.05)


def test_frozen_parameters_have_no_grads_or_optimizer_states() -> None:
    states = model_state_bytes(1e9, 1, 0, trainable=1e7)
    assert states.params == 2e9 and states.grads == pytest.approx(2e7)
    assert states.optimizer == pytest.approx(1.2e8)


S, B, H, A = 1024, 2, 1024, 16


@pytest.fixture(scope="module")
def unfused_gpt_layer():
    """A GPT layer as Korthikanti et al. assume: fp16, dropout, attention without a fused kernel."""
    cfg = GPTConfig(vocab_size=1000, seq_len=S, d_model=H, n_layers=2, n_heads=A, dropout=0.1,
                    fused_attention=False)
    with torch.device("meta"):
        model = GPT(cfg).to(torch.float16)
    model.train()
    graph = autopar.capture(model, token_inputs(B, S))
    return graph, graph.layer_blocks[0]


KORTHIKANTI = {  # (tp, sequence parallel, recompute) -> s*b*h*(...) (Table 2)
    (1, False, "none"): 34 + 5 * A * S / H,
    (4, False, "none"): 10 + 24 / 4 + 5 * A * S / (H * 4),
    (4, True, "none"): 34 / 4 + 5 * A * S / (H * 4),
    (4, False, "selective"): 10 + 24 / 4,
    (4, True, "selective"): 34 / 4,
    (1, False, "full"): 2,
    (8, True, "none"): 34 / 8 + 5 * A * S / (H * 8),
}


@pytest.mark.parametrize("tp,sp,recompute", list(KORTHIKANTI))
def test_activation_bytes_match_korthikanti(unfused_gpt_layer, tp, sp, recompute) -> None:
    graph, block = unfused_gpt_layer
    got = block_activation_bytes(graph, block, tp=tp, sequence_parallel=sp, recompute=recompute)
    expected = S * B * H * KORTHIKANTI[(tp, sp, recompute)]
    assert got.stored_bytes == pytest.approx(expected, rel=0.10)


def test_recompute_keeps_what_it_drops_as_a_transient(unfused_gpt_layer) -> None:
    graph, block = unfused_gpt_layer
    none = block_activation_bytes(graph, block, recompute="none")
    full = block_activation_bytes(graph, block, recompute="full")
    assert none.recompute_peak_bytes == 0
    assert full.recompute_peak_bytes == pytest.approx(none.stored_bytes)


def test_activation_scale_is_linear(unfused_gpt_layer) -> None:
    graph, block = unfused_gpt_layer
    one = block_activation_bytes(graph, block).stored_bytes
    assert block_activation_bytes(graph, block, scale=3.0).stored_bytes == pytest.approx(3 * one)


def test_inflight_microbatches_per_schedule() -> None:
    assert inflight_microbatches("gpipe", 4, 0, 16) == 16
    assert [inflight_microbatches("1f1b", 4, s, 16) for s in range(4)] == [4, 3, 2, 1]
    assert inflight_microbatches("1f1b", 4, 0, 2) == 2  # never more than exist
    assert inflight_microbatches("interleaved", 4, 0, 16, 2) == pytest.approx(4 * (1 + 3 / 8))


def test_an_embedding_keeps_its_token_ids_not_its_weight() -> None:
    """The embedding saves the ids it looked up (a graph input) for its backward: bytes of the
    ids, not of the table (an op's input metadata lists its weight first)."""
    from autopar.cost.activations import block_activation_bytes

    graph = autopar.capture("tiny-llama", seq=32)
    head = graph.blocks[0]
    ids = graph.inputs[0].meta.nbytes
    table = graph.params["model.embed_tokens.weight"].nbytes
    stored = block_activation_bytes(graph, head).stored_bytes
    assert ids <= stored < table
