"""LoRA against full fine-tuning, measured: peak memory per rank on this machine against the
planner's prediction.

A Llama-shaped model of about 36M parameters (fp32) fine-tunes a few steps on 2 gloo
processes (dp2, the same plan shape for both, so only what trains differs): once in full and
once with LoRA r=8 on every linear. Each process first runs the same architecture at a few
percent of the size (imports, gloo and the allocator warmed up). For rank 0 it prints the peak
resident-set growth over the measured run (VmHWM after the steps minus the resident set before
its Trainer is built: weights, gradients, optimizer states, activations, buffers and the
allocator's slack) and the plan's predicted per-device total; then the LoRA/full ratio of
each. It passes when the measured
ratio is within 20% of the predicted one.

Usage: python bench/lora_memory.py [--steps 3]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import warnings
from datetime import timedelta
from pathlib import Path

import torch
from spawned import rank0_result, status_bytes  # bench/ is on sys.path when run

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 512,
          "intermediate_size": 1536, "num_hidden_layers": 8, "num_attention_heads": 8,
          "num_key_value_heads": 8, "vocab_size": 8192, "max_position_embeddings": 512,
          "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "torch_dtype": "float32"}
LORA = "method=lora,r=8,lora_alpha=16,target_modules=all-linear"
# the same architecture at a few percent of the size: its run first warms up what is not the
# model (lazily imported modules, gloo, the allocator's arenas), so the growth measured next
# is the model's
WARMUP = dict(CONFIG, hidden_size=64, intermediate_size=128, num_attention_heads=2,
              num_key_value_heads=2, vocab_size=512)
SEQ, BATCH, TOLERANCE = 128, 4, 0.20


def _plan(config_path: str, peft: str | None):
    import autopar

    return autopar.plan(config_path, devices=2, global_batch=BATCH, seq=SEQ, cluster="cpu",
                        task="finetune", peft=peft,
                        constraints=dict(dp=2, tp=1, pp=1, zero_stage=0, precision="fp32",
                                         microbatch_size=2, num_microbatches=1))


def _worker(rank: int, port: int, runs: list[tuple[str, dict]], steps: int, out) -> None:
    import torch.distributed as dist

    from autopar.codegen import generated_program
    from autopar.models.source import describe_source
    from autopar.plan import Plan
    from autopar.train import Trainer

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=300))
    try:
        for config_path, plan_dict in runs:  # the warm-up, then the run measured
            gc.collect()
            before = status_bytes("VmRSS")
            source, plan = describe_source(config_path), Plan.from_dict(plan_dict)
            trainer = Trainer(source, plan, program=generated_program(plan, source),
                              device="cpu")
            losses = trainer.train(steps)
            grown = status_bytes("VmHWM") - before
            del trainer
        dist.barrier()
        if rank == 0:
            out.put(("ok", (grown, losses[-1])))
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        out.put(("error", f"rank {rank}: {type(exc).__name__}: {exc}"))
    finally:
        dist.destroy_process_group()


def _run(runs: list[tuple[str, object]], steps: int) -> tuple[int, float]:
    return rank0_result(_worker, 2, ([(path, plan.to_dict()) for path, plan in runs], steps))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    mib = 2**20
    with tempfile.TemporaryDirectory() as tmp:
        config_path, warmup_path = str(Path(tmp) / "llama-36m.json"), str(Path(tmp) / "w.json")
        Path(config_path).write_text(json.dumps(CONFIG))
        Path(warmup_path).write_text(json.dumps(WARMUP))
        rows = {}
        print(f"{'task':<6} {'trains':>12} {'peak RSS+ MiB':>13} {'predicted MiB':>13} "
              f"{'last loss':>9}")
        for name, peft in (("full", None), ("lora", LORA)):
            plan = _plan(config_path, peft)
            grown, loss = _run([(warmup_path, _plan(warmup_path, peft)), (config_path, plan)],
                               args.steps)
            predicted = plan.predicted.stages[0]["memory"]["total"]
            rows[name] = (grown, predicted)
            print(f"{name:<6} {plan.trainable_params:>12,} {grown / mib:>13.1f} "
                  f"{predicted / mib:>13.1f} {loss:>9.4f}")
    measured = rows["lora"][0] / rows["full"][0]
    predicted = rows["lora"][1] / rows["full"][1]
    error = measured / predicted - 1
    print(f"LoRA / full: measured {measured:.3f}, predicted {predicted:.3f} "
          f"({error:+.1%}; limit +-{TOLERANCE:.0%})")
    return 0 if abs(error) <= TOLERANCE else 1


if __name__ == "__main__":
    sys.exit(main())
