"""Cost-model accuracy: predicted vs measured training step time of a small GPT on this machine.

Each configuration trains the plain-PyTorch GPT (autopar.models.GPT) for a few steps on 1 or 2
gloo processes, one thread each, with PyTorch's own pieces (DDP, fully_shard, DTensor
parallelize_module, torch.utils.checkpoint); the median step time is compared with
autopar.cost.estimate() calibrated by an `autopar profile` of this machine.

Usage: python bench/cost_accuracy.py [--profile PROFILE.yaml] [--steps 6]
(without --profile, a quick profile is measured first, ~30 s).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.multiprocessing as mp

MODEL = dict(vocab_size=1024, seq_len=128, d_model=256, n_layers=4, n_heads=8)


@dataclass(frozen=True)
class Case:
    name: str
    world: int = 1
    dp: int = 1
    tp: int = 1
    zero3: bool = False
    recompute: bool = False
    microbatch: int = 8


CASES = [
    Case("single mb8"),
    Case("single mb8 recompute", recompute=True),
    Case("single mb16", microbatch=16),
    Case("dp2 mb8", world=2, dp=2),
    Case("dp2 mb8 recompute", world=2, dp=2, recompute=True),
    Case("dp2 zero3 (fully_shard) mb8", world=2, dp=2, zero3=True),
    Case("tp2 mb8", world=2, tp=2),
    Case("tp2 mb8 recompute", world=2, tp=2, recompute=True),
]


class Checkpointed(torch.nn.Module):
    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=False)


def build(case: Case, rank: int) -> torch.nn.Module:
    from autopar.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(**MODEL))
    if case.tp > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        mesh = init_device_mesh("cpu", (case.tp,), mesh_dim_names=("tp",))
        for layer in model.layers:
            parallelize_module(layer, mesh, {"attn.qkv": ColwiseParallel(),
                                             "attn.proj": RowwiseParallel(),
                                             "mlp.fc": ColwiseParallel(),
                                             "mlp.proj": RowwiseParallel()})
    if case.recompute:
        for i, layer in enumerate(model.layers):
            model.layers[i] = Checkpointed(layer)
    if case.zero3:
        from torch.distributed.fsdp import fully_shard

        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
    elif case.dp > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    return model


def worker(rank: int, case: Case, port: int, steps: int, out: mp.Queue) -> None:
    torch.set_num_threads(1)
    if case.world > 1:
        import torch.distributed as dist

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=case.world,
                                timeout=__import__("datetime").timedelta(seconds=120))
    model = build(case, rank)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(1 + (rank if case.dp > 1 else 0))
    ids = torch.randint(0, MODEL["vocab_size"], (case.microbatch, MODEL["seq_len"] + 1),
                        generator=gen)
    times = []
    for _ in range(steps + 2):
        start = time.perf_counter()
        logits = model(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    if case.world > 1:
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()
    if rank == 0:
        out.put(statistics.median(times[2:]))


def measure(case: Case, steps: int) -> float:
    from autopar.calibrate.profile_comm import free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, case, port, steps, out)) for r in range(case.world)]
    for p in procs:
        p.start()
    try:
        result = out.get(timeout=600)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    return result


def predict(case: Case, cluster) -> float:
    import autopar
    from autopar.cost.config import ParallelConfig
    from autopar.cost.estimate import estimate
    from autopar.cost.precision import FP32
    from autopar.models import GPT, GPTConfig, token_inputs

    with torch.device("meta"):
        model = GPT(GPTConfig(**MODEL))
    graph = autopar.capture(model, token_inputs(case.microbatch, MODEL["seq_len"]))
    config = ParallelConfig(dp=case.dp, tp=case.tp, zero_stage=3 if case.zero3 else 0,
                            microbatch_size=case.microbatch,
                            recompute="full" if case.recompute else "none", precision=FP32)
    return estimate(graph, cluster, config).step_time_s


def spearman(a: list[float], b: list[float]) -> float:
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1])


def print_summary(rows: list[tuple[float, float, float]], profile: str) -> None:
    """Rank correlation and median |error| of (predicted, measured, error) rows."""
    preds, meas = [r[0] for r in rows], [r[1] for r in rows]
    print(f"\nSpearman rank correlation: {spearman(preds, meas):.2f}   "
          f"median |error|: {statistics.median(abs(r[2]) for r in rows):.0%}   "
          f"(profile: {profile})")


def quick_profile(nprocs: int) -> str:
    """Measure this machine with a quick ``nprocs``-process profile; returns the YAML path."""
    from autopar.calibrate.profile import profile_machine, write_profile

    print(f"profiling this machine ({nprocs} processes, quick)...", file=sys.stderr)
    path = os.path.join(tempfile.mkdtemp(), "profile.yaml")
    write_profile(profile_machine(nprocs=nprocs, quick=True), path)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", help="profile YAML from `autopar profile` (default: measure one)")
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    from autopar.cost.hardware import load_cluster

    path = args.profile or quick_profile(nprocs=2)
    cluster = load_cluster(path)
    rows = []
    print(f"{'configuration':<30} {'predicted s':>11} {'measured s':>10} {'error':>7}")
    for case in CASES:
        pred, meas = predict(case, cluster), measure(case, args.steps)
        err = (pred - meas) / meas
        rows.append((pred, meas, err))
        print(f"{case.name:<30} {pred:>11.3f} {meas:>10.3f} {err:>+7.0%}")
    print_summary(rows, path)


if __name__ == "__main__":
    main()
