"""``autopar generate MODEL --prompts FILE``: cached generation from a model or an artifact."""

from __future__ import annotations

import os
import time
from pathlib import Path

import click

from autopar.artifact import load_artifact
from autopar.data.instruction import load_hf_tokenizer, tokenizer_beside
from autopar.errors import PlanError
from autopar.serve.generate import Generator, new_tokens
from autopar.serve.prompts import print_generated, read_prompts
from autopar.train.launch import init_process_group


@click.command("generate")
@click.argument("model")
@click.option("--prompts", required=True,
              help="JSONL of {\"ids\": [...]} or {\"prompt\": \"...\"} lines, or a text file "
                   "of one prompt per line.")
@click.option("--max-new-tokens", default=32, show_default=True, type=int)
@click.option("--sample", is_flag=True, help="Sample instead of greedy decoding.")
@click.option("--temperature", default=1.0, show_default=True, type=float)
@click.option("--top-k", type=int, default=None)
@click.option("--top-p", type=float, default=None)
@click.option("--eos", "eos_token_id", type=int, default=None, help="Stop token id.")
@click.option("--seed", default=0, show_default=True, type=int, help="Sampling seed.")
@click.option("--tokenizer", default=None,
              help="Hugging Face tokenizer folder for text prompts and output (default: "
                   "MODEL's own, when it is a folder with one).")
@click.option("--device", type=click.Choice(["cpu", "cuda", "npu"]), default="cpu",
              show_default=True, help="Where the model runs (under torchrun: each process "
                                      "its LOCAL_RANK's device; cpu uses gloo, cuda NCCL).")
@click.option("--timeout", "timeout_s", default=600, show_default=True,
              type=click.IntRange(min=1),
              help="Under torchrun: seconds a collective may wait for its peers.")
def generate_cmd(model: str, prompts: str, max_new_tokens: int, sample: bool,
                 temperature: float, top_k: int | None, top_p: float | None,
                 eos_token_id: int | None, seed: int, tokenizer: str | None, device: str,
                 timeout_s: int) -> None:
    """Generate from MODEL (a shipped name, a Hugging Face folder, or an artifact DIR with
    its latest checkpoint) with a KV cache. One JSON line per prompt on stdout (its new token
    ids, and text with a tokenizer); tokens/s on stderr. Under torchrun, an artifact's plan
    (pp=1) lays the model out across the processes.

    \b
    Examples:
      autopar generate tiny-llama --prompts prompts.jsonl --max-new-tokens 64
      autopar generate ./Llama-3.2-1B --prompts questions.txt --sample --top-p 0.9
      torchrun --nproc-per-node 2 -m autopar generate DIR --prompts prompts.jsonl
    """
    import torch.distributed as dist

    folder = tokenizer or tokenizer_beside(model)
    tok = None
    if folder is not None:
        tok = load_hf_tokenizer(folder)
    ids = read_prompts(prompts, tok)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    plan = None
    if world > 1:
        if not (Path(model) / "manifest.json").is_file():
            raise PlanError(f"{world} processes need a plan: pass an artifact DIR, or run "
                            f"without torchrun")
        _, plan = load_artifact(model)
        plan.check_world_size(world)
    where = device
    if device != "cpu":
        import torch

        if not torch.accelerator.is_available():
            raise PlanError(f"--device {device}: this machine has no accelerator; use --device "
                            f"cpu")
        where = f"{device}:{int(os.environ.get('LOCAL_RANK', '0'))}"
        torch.accelerator.set_device_index(int(os.environ.get("LOCAL_RANK", "0")))
    if world > 1:
        init_process_group({"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}[device], timeout_s)
    try:
        generator = Generator(model, plan, device=where)
        start = time.perf_counter()
        out = generator.generate(ids, max_new_tokens=max_new_tokens, do_sample=sample,
                                 temperature=temperature, top_k=top_k, top_p=top_p,
                                 eos_token_id=eos_token_id, seed=seed)
        seconds = time.perf_counter() - start
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if int(os.environ.get("RANK", "0")) != 0:
        return

    print_generated(new_tokens(out, ids, eos_token_id), tok, seconds)
