"""The plain-PyTorch GPT used by examples and runtime tests."""

from __future__ import annotations

import torch

from autopar.models import GPT, GPTConfig


def test_fused_and_unfused_attention_agree(tiny_gpt_config, token_ids) -> None:
    torch.manual_seed(0)
    fused = GPT(tiny_gpt_config).eval()
    unfused_cfg = GPTConfig(**{**tiny_gpt_config.__dict__, "fused_attention": False})
    unfused = GPT(unfused_cfg).eval()
    unfused.load_state_dict(fused.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(fused(token_ids), unfused(token_ids), rtol=1e-5, atol=1e-5)


def test_head_is_tied_and_output_is_logits(tiny_gpt, token_ids) -> None:
    assert tiny_gpt.head.weight is tiny_gpt.tok_emb.weight
    out = tiny_gpt(token_ids)
    assert out.shape == (*token_ids.shape, tiny_gpt.cfg.vocab_size)
