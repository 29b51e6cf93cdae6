"""Memory per rank in fp32 and bf16, measured against the cost model's prediction.

A GPT of about 25M parameters trains a few steps on 2 gloo processes under dp2 ZeRO-3 and
under tp2 (the planner's full-width layout), each in fp32 and in bf16 (autocast compute,
FSDP2 MixedPrecisionPolicy, fp32 master weights, optimizer states and reductions). For rank 0
it prints the model states it holds (parameters + gradients + optimizer states, bytes of its
local tensors after a step), the peak resident-set growth over the run (host memory: weights,
activations, transient casts and the allocator's slack), and the plan's prediction of the
same two quantities. It also prints each run's last loss.

Usage: python bench/precision_memory.py [--steps 3]
"""

from __future__ import annotations

import argparse
import os
import resource
import warnings
from datetime import timedelta

import torch
from spawned import rank0_result  # bench/ is on sys.path when run

MODEL = dict(vocab_size=8192, seq_len=256, d_model=512, n_layers=8, n_heads=8)
WIDE = dict(MODEL, d_model=4096, n_heads=32)  # whose planned tp layout the tp cases copy
GLOBAL_BATCH = 8


def _plan(pins: dict, precision: str):
    """(plan, predicted memory of rank 0 for the layout that runs)."""
    import autopar
    import autopar.cost.hardware
    from autopar.cost.config import ParallelConfig
    from autopar.cost.estimate import estimate
    from autopar.cost.precision import parse_precision
    from autopar.models import GPT, GPTConfig, token_inputs
    from autopar.search.sharding import solve_layouts

    with torch.device("meta"):
        model = GPT(GPTConfig(**MODEL))
    graph = autopar.capture(model, token_inputs(1, MODEL["seq_len"]))
    plan = autopar.plan(graph, devices=2, global_batch=GLOBAL_BATCH, cluster="cpu",
                        constraints=dict(pins, pp=1, precision=precision))
    layouts = None
    if plan.mesh["tp"] > 1:  # the planner's layout for the same GPT at full width
        with torch.device("meta"):
            wide = GPT(GPTConfig(**WIDE))
        wide_graph = autopar.capture(wide, token_inputs(1, MODEL["seq_len"]))
        layout = autopar.plan(wide_graph, devices=2, global_batch=2, memory_limit_gb=1e6,
                              constraints=dict(tp=2, pp=1, sequence_parallel=False)
                              ).placements["params"]
        params = plan.placements["params"]
        for fqn, placement in params.items():
            dp = [p for p in placement.split("+") if p.endswith("@dp")]
            tp = [p for p in layout[fqn].split("+") if p.endswith("@tp")]
            params[fqn] = "+".join(tp + dp) or "Replicate"
        # the same model class at full width: the same ops, so its solved layout indexes
        # this graph's blocks too
        layouts = solve_layouts(wide_graph, [2], autopar.cost.hardware.load_cluster(
            "a100-80g"))[0][2]
    config = ParallelConfig(
        dp=plan.mesh["dp"], tp=plan.mesh["tp"], pp=1, ep=1,
        sequence_parallel=plan.sequence_parallel, zero_stage=plan.zero_stage,
        microbatch_size=plan.microbatch_size, num_microbatches=plan.num_microbatches,
        recompute=tuple(plan.recompute), precision=parse_precision(plan.precision),
        tp_layouts=layouts)
    return plan, estimate(graph, "cpu", config).stages[0].memory


def _local_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


def _worker(rank: int, port: int, plan_dict: dict, steps: int, out) -> None:
    import torch.distributed as dist

    from autopar.codegen import generated_program
    from autopar.models import GPT, GPTConfig
    from autopar.models.source import describe_source
    from autopar.plan import Plan
    from autopar.train import Trainer

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=300))
    try:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        source, plan = describe_source(GPT(GPTConfig(**MODEL))), Plan.from_dict(plan_dict)
        trainer = Trainer(source, plan, program=generated_program(plan, source), device="cpu")
        losses = []
        for _ in range(steps):
            for p in trainer.model.parameters():  # keep the gradients to count them
                p.grad = None
            losses.append(trainer.train_step())
        params = list(trainer.model.parameters())
        states = [t for s in trainer.optimizer.state.values() for t in s.values()
                  if isinstance(t, torch.Tensor) and t.dim() > 0]
        # the optimizer's zero_grad dropped the gradients: they are the parameters' size in
        # the reduce dtype (fp32) while they live
        held = {"params": _local_bytes(params), "grads": _local_bytes(params),
                "optimizer": _local_bytes(states)}
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
        dist.barrier()
        if rank == 0:
            out.put(("ok", (held, peak, losses[-1])))
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        out.put(("error", f"rank {rank}: {type(exc).__name__}: {exc}"))
    finally:
        dist.destroy_process_group()


def _run(plan, steps: int):
    return rank0_result(_worker, 2, (plan.to_dict(), steps), timeout_s=600)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    cases = {"dp2 ZeRO-3": dict(tp=1, dp=2, zero_stage=3, microbatch_size=4),
             "tp2": dict(tp=2, dp=1, microbatch_size=4, sequence_parallel=False)}
    mib = 2**20
    print(f"{'case':<12} {'precision':<9} {'states MiB':>10} {'predicted':>9} "
          f"{'peak RSS+ MiB':>13} {'predicted':>9} {'last loss':>9}")
    for name, pins in cases.items():
        for precision in ("fp32", "bf16"):
            plan, memory = _plan(pins, precision)
            held, peak, loss = _run(plan, args.steps)
            states = sum(held.values())
            predicted_states = memory.params + memory.grads + memory.optimizer
            print(f"{name:<12} {precision:<9} {states / mib:>10.1f} "
                  f"{predicted_states / mib:>9.1f} {peak / mib:>13.1f} "
                  f"{memory.total / mib:>9.1f} {loss:>9.4f}")


if __name__ == "__main__":
    main()
