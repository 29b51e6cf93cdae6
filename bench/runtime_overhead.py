"""Runtime overhead: autopar's Trainer vs the same strategy written by hand with plain torch
(DDP, fully_shard, parallelize_module) on the same 2 gloo processes, same model and data.

Usage: python bench/runtime_overhead.py [--steps 8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODEL = dict(vocab_size=1024, seq_len=128, d_model=256, n_layers=4, n_heads=8)
CASES = {"dp2 (DDP)": dict(dp=2, zero_stage=0), "dp2 ZeRO-3 (fully_shard)": dict(dp=2,
                                                                                 zero_stage=3),
         "tp2 (DTensor)": dict(tp=2, dp=1, sequence_parallel=False)}
GLOBAL_BATCH = 8


def _plan(pins: dict):
    import autopar
    from autopar.models import GPT, GPTConfig, token_inputs

    with torch.device("meta"):
        model = GPT(GPTConfig(**MODEL))
    graph = autopar.capture(model, token_inputs(1, MODEL["seq_len"]))
    plan = autopar.plan(graph, devices=2, global_batch=GLOBAL_BATCH,
                        constraints={"pp": 1, "num_microbatches": 1, **pins})
    if pins.get("tp", 1) > 1:  # the Megatron split, as the hand-written version does
        for fqn in plan.placements["params"]:
            if fqn.endswith((".qkv.weight", ".fc.weight")):
                plan.placements["params"][fqn] = "Shard(0)@tp"
            elif fqn.endswith((".attn.proj.weight", ".mlp.proj.weight")):
                plan.placements["params"][fqn] = "Shard(1)@tp"
    return plan


def _by_hand(pins: dict, rank: int):
    """The strategy as a PyTorch user writes it."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.data.synthetic import synthetic_batch
    from autopar.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(**MODEL))
    if pins.get("tp", 1) > 1:
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        mesh = init_device_mesh("cpu", (2,))
        for layer in model.layers:
            parallelize_module(layer, mesh, {"attn.qkv": ColwiseParallel(),
                                             "attn.proj": RowwiseParallel(),
                                             "mlp.fc": ColwiseParallel(),
                                             "mlp.proj": RowwiseParallel()})
        rows = slice(0, GLOBAL_BATCH)
    elif pins["zero_stage"] == 3:
        from torch.distributed.fsdp import fully_shard

        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
        rows = slice(rank * 4, rank * 4 + 4)
    else:
        model = torch.nn.parallel.DistributedDataParallel(model)
        rows = slice(rank * 4, rank * 4 + 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(i: int) -> None:
        tokens = synthetic_batch(i, 0, GLOBAL_BATCH, MODEL["seq_len"], MODEL["vocab_size"])[rows]
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        params = [p for p in model.parameters() if p.grad is not None]
        if pins.get("tp", 1) == 1:
            torch.nn.utils.clip_grad_norm_(params, 1.0)
        else:  # torch's clip refuses mixed DTensor / tensor gradients: the user writes this
            from autopar.train.trainer import clip_grad_norm

            clip_grad_norm(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def worker(rank: int, port: int, name: str, mode: str, steps: int, plan_dict: dict, out) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    if mode == "autopar":
        from autopar.codegen import generated_program
        from autopar.models import GPT, GPTConfig
        from autopar.models.source import describe_source
        from autopar.plan import Plan
        from autopar.train import Trainer

        source, plan = describe_source(GPT(GPTConfig(**MODEL))), Plan.from_dict(plan_dict)
        trainer = Trainer(source, plan, program=generated_program(plan, source), device="cpu",
                          seed=0)
        step = lambda i: trainer.train_step()  # noqa: E731
    else:
        step = _by_hand(CASES[name], rank)
    times = []
    for i in range(steps):
        dist.barrier()
        start = time.perf_counter()
        step(i)
        times.append(time.perf_counter() - start)
    dist.barrier()
    if rank == 0:
        out.put(statistics.median(times[2:]))
    dist.destroy_process_group()


def measure(name: str, mode: str, steps: int, plan_dict: dict) -> float:
    from autopar.calibrate.profile_comm import free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, port, name, mode, steps, plan_dict, out))
             for r in range(2)]
    for p in procs:
        p.start()
    try:
        return out.get(timeout=600)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    print(f"{'strategy':<28} {'by hand s':>9} {'autopar s':>9} {'ratio':>6}")
    for name, pins in CASES.items():
        plan_dict = _plan(pins).to_dict()
        hand = measure(name, "torch", args.steps, plan_dict)
        ours = measure(name, "autopar", args.steps, plan_dict)
        print(f"{name:<28} {hand:>9.3f} {ours:>9.3f} {ours / hand:>6.2f}")


if __name__ == "__main__":
    main()
