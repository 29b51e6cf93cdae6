"""A small GPT in plain PyTorch (no transformers): the model the runtime tests train.

Pre-norm blocks, fused SDPA attention, GELU MLP, tied embedding and head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class GPTConfig:
    vocab_size: int = 256
    seq_len: int = 64
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    mlp_ratio: int = 4
    dropout: float = 0.0
    fused_attention: bool = True  # False: explicit scores/softmax/dropout (Megatron's unfused path)


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.head_dim = cfg.d_model // cfg.n_heads
        self.fused = cfg.fused_attention
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.attn_drop = nn.Dropout(cfg.dropout)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        qkv = self.qkv(x)
        # Head-major layout (per head: its q, k, v): a column split of qkv over tensor-parallel
        # ranks then hands each rank whole heads, so the same code runs sharded or not.
        heads = qkv.shape[-1] // (3 * self.head_dim)
        q, k, v = qkv.view(b, s, heads, 3 * self.head_dim).split(self.head_dim, dim=-1)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if self.fused:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                               dropout_p=self.attn_drop.p if self.training else 0.0)
        else:
            scores = (q @ k.transpose(-2, -1)) * (q.shape[-1] ** -0.5)
            causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
            scores = scores.masked_fill(~causal, float("-inf"))
            y = self.attn_drop(scores.softmax(dim=-1)) @ v
        return self.resid_drop(self.proj(y.transpose(1, 2).reshape(b, s, heads * self.head_dim)))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model)
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def _init_weights(module: nn.Module) -> None:
    """GPT-2's initialisation: N(0, 0.02) weights, zero biases, norms at ones and zeros."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
        if getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.LayerNorm):
        # what the constructor already gives; spelled out so that a meta-built model, whose
        # constructor wrote nothing, gets it from this rule alone
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight
        self.apply(_init_weights)

    def init_module(self, module: nn.Module) -> None:
        """Initialise the parameters ``module`` owns directly, in place (the per-module rule
        :func:`autopar.parallel.init.materialize` runs on meta-built models)."""
        _init_weights(module)

    def forward(self, idx: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        # positions: the tokens' places in the whole sequence when idx holds a share of it
        # (context parallelism); by default 0, 1, ...
        pos = torch.arange(idx.shape[1], device=idx.device) if positions is None else positions
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.ln_f(x))
