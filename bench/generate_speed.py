"""Cached generation speed on this machine: tokens per second of autopar's Generator (static KV
cache) against recomputing the whole prefix for every new token, and against Hugging Face's
``generate`` with its static cache, for a small Llama-shaped model generating 256 new tokens
greedily from a 32-token prompt (batch 1, fp32, one process). Each is timed after a warm-up
run; the greedy tokens of all three must agree.

Usage: python bench/generate_speed.py [--new-tokens 256] [--repeats 3]
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from autopar import Generator
from autopar.models.hf import build_model, load_config

MODEL = dict(load_config("tiny-llama"), hidden_size=256, intermediate_size=704,
             num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=4,
             vocab_size=8192, max_position_embeddings=1024)


def _recompute(model, ids: torch.Tensor, new: int) -> torch.Tensor:
    """Greedy decoding without a cache: the whole sequence again for every token."""
    with torch.no_grad():
        for _ in range(new):
            logits = model(input_ids=ids, use_cache=False).logits
            ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids


def _hf_static(model, ids: torch.Tensor, new: int) -> torch.Tensor:
    from transformers import StaticCache

    # (autopar builds models for training graphs, with use_cache off: generate needs it on)
    cache = StaticCache(config=model.config, max_cache_len=ids.shape[1] + new)
    return model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                          cache=cache, use_cache=True, pad_token_id=0)


def _timed(fn, repeats: int) -> tuple[float, torch.Tensor]:
    out = fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return best, out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.manual_seed(0)
    model = build_model(MODEL, device="cpu", dtype=torch.float32).eval()
    params = sum(p.numel() for p in model.parameters())
    ids = torch.randint(3, MODEL["vocab_size"], (1, args.prompt),
                        generator=torch.Generator().manual_seed(1))
    new = args.new_tokens
    generator = Generator(model)
    runs = {
        "autopar Generator (static cache)":
            lambda: generator.generate(ids, max_new_tokens=new),
        "recompute the prefix (no cache)": lambda: _recompute(model, ids, new),
        "Hugging Face generate (static cache)": lambda: _hf_static(model, ids, new),
    }
    print(f"Llama-shaped model, {params / 1e6:.1f} M parameters, fp32, "
          f"{torch.get_num_threads()} threads; prompt {args.prompt}, {new} new tokens, batch 1")
    print(f"{'decoder':<38} {'seconds':>8} {'tokens/s':>9}")
    speed, tokens = {}, {}
    for name, fn in runs.items():
        seconds, out = _timed(fn, args.repeats)
        speed[name], tokens[name] = new / seconds, out
        print(f"{name:<38} {seconds:>8.3f} {speed[name]:>9.1f}")
    names = list(runs)
    same = all(torch.equal(tokens[names[0]], tokens[n]) for n in names[1:])
    cached = speed[names[0]] / speed[names[1]]
    against_hf = speed[names[0]] / speed[names[2]]
    print(f"cache vs recompute: {cached:.1f}x (at least 5x); autopar vs Hugging Face: "
          f"{against_hf:.2f}x (at least 0.9x); same greedy tokens: {same}")
    return 0 if same and cached >= 5 and against_hf >= 0.9 else 1


if __name__ == "__main__":
    sys.exit(main())
