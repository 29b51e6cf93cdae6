"""Cost-model accuracy on autopar's own runtime: predicted vs measured step time of plans.

Each case is an ``autopar.plan`` for a small GPT on 4 gloo processes (pins choose the
strategy; tensor-parallel cases take the layout the planner chooses for the same GPT at full
width, since at this size it rightly splits little). The plan is trained through its generated
program by ``autopar.train.Trainer`` for a few steps, one thread per process, and the median
step time is compared with ``autopar.cost.estimate`` for the same choice in fp32 (the
runtime trains in fp32 on CPU), calibrated by an ``autopar profile`` of this machine.

Usage: python bench/runtime_cost_accuracy.py [--profile PROFILE.yaml] [--steps 6] [--only NAME]
(without --profile, a quick 4-process profile is measured first, about a minute).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings
from datetime import timedelta

import torch
from cost_accuracy import print_summary, quick_profile  # bench/ is on sys.path when run
from spawned import rank0_result

MODEL = dict(vocab_size=1024, seq_len=128, d_model=256, n_layers=4, n_heads=8)
GLOBAL_BATCH = 16
WORLD = 4
FULL_WIDTH = dict(MODEL, d_model=4096, n_heads=32)  # whose planned tp layout the cases copy

# name -> constraints pinned for autopar.plan (4 devices, global batch 16)
CASES: dict[str, dict] = {
    "dp4": dict(pp=1, tp=1, dp=4, zero_stage=0, microbatch_size=4, recompute="none"),
    "dp4 zero3": dict(pp=1, tp=1, dp=4, zero_stage=3, microbatch_size=4, recompute="none"),
    "dp4 full recompute": dict(pp=1, tp=1, dp=4, zero_stage=0, microbatch_size=4,
                               recompute="full"),
    "dp2 tp2": dict(pp=1, tp=2, dp=2, zero_stage=2, microbatch_size=8, recompute="none",
                    sequence_parallel=False),
    "tp4": dict(pp=1, tp=4, dp=1, microbatch_size=8, recompute="none", sequence_parallel=False),
    "pp2 dp2 1f1b": dict(pp=2, tp=1, dp=2, zero_stage=0, microbatch_size=2, schedule="1f1b",
                         recompute="none"),
    "pp4 gpipe": dict(pp=4, tp=1, dp=1, microbatch_size=2, schedule="gpipe", recompute="none"),
    "pp4 1f1b mb4": dict(pp=4, tp=1, dp=1, microbatch_size=4, schedule="1f1b",
                         recompute="none"),
}


def make_plan(graph, pins: dict):
    import autopar

    plan = autopar.plan(graph, devices=WORLD, global_batch=GLOBAL_BATCH,
                        constraints=dict(pins, ep=1, offload=[]))
    if plan.mesh["tp"] > 1:  # the planner's layout for the same GPT at full width
        from autopar.models import GPT, GPTConfig, token_inputs

        with torch.device("meta"):
            wide = GPT(GPTConfig(**FULL_WIDTH))
        layout = autopar.plan(autopar.capture(wide, token_inputs(1, MODEL["seq_len"])),
                              devices=plan.mesh["tp"], global_batch=plan.mesh["tp"],
                              constraints=dict(tp=plan.mesh["tp"], pp=1,
                                               sequence_parallel=False)).placements["params"]
        params = plan.placements["params"]
        for fqn, placement in params.items():
            dp = [p for p in placement.split("+") if p.endswith("@dp")]
            tp = [p for p in layout[fqn].split("+") if p.endswith("@tp")]
            params[fqn] = "+".join(tp + dp) or "Replicate"
    return plan


def predict(graph, plan, cluster) -> float:
    """The cost model for the plan's choice with fp32 compute and states (as the runtime)."""
    from autopar.cost.config import ParallelConfig
    from autopar.cost.estimate import estimate
    from autopar.cost.precision import FP32

    config = ParallelConfig(
        dp=plan.mesh["dp"], tp=plan.mesh["tp"], pp=plan.mesh["pp"], ep=plan.mesh["ep"],
        sequence_parallel=plan.sequence_parallel, zero_stage=plan.zero_stage,
        microbatch_size=plan.microbatch_size, num_microbatches=plan.num_microbatches,
        schedule=plan.schedule, virtual_stages=plan.virtual_stages,
        recompute=tuple(plan.recompute), offload=frozenset(plan.offload),
        stages=tuple(tuple(s) for s in plan.stages), precision=FP32)
    return estimate(graph, cluster, config).step_time_s


def _worker(rank: int, port: int, source: dict, plan_dict: dict, steps: int, out) -> None:
    import torch.distributed as dist

    from autopar.plan import Plan
    from autopar.train import Trainer

    warnings.filterwarnings("ignore", category=FutureWarning)  # pipelining's pytree notices
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=300))
    try:
        from autopar.codegen import generated_program

        plan = Plan.from_dict(plan_dict)
        trainer = Trainer(source, plan, program=generated_program(plan, source), device="cpu",
                          seed=0)
        times = []
        for _ in range(steps + 2):
            dist.barrier()
            start = time.perf_counter()
            trainer.train_step()
            times.append(time.perf_counter() - start)
        dist.barrier()
        if rank == 0:
            out.put(("ok", statistics.median(times[2:])))
    except Exception as exc:  # reported to the parent as text
        out.put(("error", f"rank {rank}: {type(exc).__name__}: {exc}"))
    finally:
        dist.destroy_process_group()


def measure(source: dict, plan, steps: int) -> float:
    return rank0_result(_worker, WORLD, (source, plan.to_dict(), steps), timeout_s=900)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", help="profile YAML from `autopar profile` (default: measure one)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--only", action="append", help="run only these cases (repeatable)")
    args = ap.parse_args()
    import autopar
    from autopar.cost.hardware import load_cluster
    from autopar.models import GPT, GPTConfig, token_inputs
    from autopar.models.source import describe_source

    path = args.profile or quick_profile(nprocs=WORLD)
    cluster = load_cluster(path)
    model = GPT(GPTConfig(**MODEL))
    source = describe_source(model)
    names = args.only or list(CASES)
    rows = []
    print(f"{'plan (4 processes)':<22} {'predicted s':>11} {'measured s':>10} {'error':>7}")
    for name in names:
        pins = CASES[name]
        mb = pins["microbatch_size"]
        graph = autopar.capture(model, token_inputs(mb, MODEL["seq_len"]))
        plan = make_plan(graph, pins)
        pred, meas = predict(graph, plan, cluster), measure(source, plan, args.steps)
        err = (pred - meas) / meas
        rows.append((pred, meas, err))
        print(f"{name:<22} {pred:>11.3f} {meas:>10.3f} {err:>+7.0%}", flush=True)
    if len(rows) > 1:
        print_summary(rows, path)


if __name__ == "__main__":
    main()
