"""No rank holds the whole model: a Hugging Face checkpoint of about 1B parameters loaded
under tp4 on 4 gloo processes.

The bench writes a random checkpoint shaped like TinyLlama-1.1B (bench/data/tinyllama-1b.json,
fp32 safetensors in 1 GiB shards with their index, written tensor by tensor: the writer never
holds the model either), plans it on 4 devices at tp=4 (the planner's layout, fp32), and
builds the Trainer with ``init_from=`` on 4 processes. For each rank it prints its peak
resident set (VmHWM, the interpreter and libraries included), the bytes it read from the
files, the bytes of the shards it holds, each also as a share of the full model's bytes
(the planner's layout for training at 2048 tokens; loading does not depend on it).
It passes when every rank's peak stays under 40% of the model.

Usage: python bench/hf_load_memory.py [--folder DIR] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import tempfile
from datetime import timedelta
from pathlib import Path

import torch
import torch.multiprocessing as mp
from spawned import status_bytes  # bench/ is on sys.path when run

CONFIG = Path(__file__).resolve().parent / "data" / "tinyllama-1b.json"
DEVICES, SEQ, BATCH, LIMIT = 4, 2048, 32, 0.40


def write_checkpoint(folder: Path, shard_bytes: int = 2**30) -> int:
    """A random fp32 checkpoint of CONFIG's model in ``folder``; returns its tensor bytes."""
    from safetensors.torch import save_file

    from autopar.models.hf import build_model

    model = build_model(json.loads(CONFIG.read_text()), device="meta", dtype=torch.float32)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    gen = torch.Generator().manual_seed(0)
    groups: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nbytes = 4 * int(torch.Size(shape).numel())
        if groups[-1] and size + nbytes > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    weight_map, total = {}, 0
    for i, group in enumerate(groups):
        file = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {n: torch.randn(shapes[n], generator=gen) * 0.02 for n in group}
        save_file(tensors, str(folder / file), metadata={"format": "pt"})
        total += sum(t.numel() * 4 for t in tensors.values())
        weight_map.update(dict.fromkeys(group, file))
        del tensors
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}))
    model.config.save_pretrained(str(folder))
    return total


def _rank(rank: int, port: int, out, source: dict, plan_dict: dict, program: str,
          folder: str) -> None:
    import torch.distributed as dist

    from autopar.codegen import load_program
    from autopar.plan import Plan
    from autopar.train import Trainer

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=DEVICES,
                            timeout=timedelta(seconds=600))
    try:
        before = status_bytes("VmHWM")
        trainer = Trainer(source, Plan.from_dict(plan_dict), program=load_program(program),
                          device="cpu", init_from=folder)
        peak = status_bytes("VmHWM")
        out.put((rank, dict(before=before, peak=peak, read=trainer.weights.bytes_read,
                            local=trainer.init_report.local_bytes)))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", help="checkpoint folder (written there if empty)")
    parser.add_argument("--keep", action="store_true", help="keep the written checkpoint")
    args = parser.parse_args()

    import autopar
    from autopar.calibrate.profile_comm import free_port
    from autopar.codegen import program_text
    from autopar.models.source import describe_source

    folder = Path(args.folder or tempfile.mkdtemp(prefix="autopar-1b-"))
    folder.mkdir(parents=True, exist_ok=True)
    try:
        if not (folder / "model.safetensors.index.json").is_file():
            print(f"writing a random checkpoint to {folder} ...", flush=True)
            write_checkpoint(folder)
        model_bytes = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
        config = str(CONFIG)
        # the layout the planner picks for training at this model's context
        plan = autopar.plan(autopar.capture(config, seq=SEQ), devices=DEVICES,
                            global_batch=BATCH, constraints=dict(
                                tp=DEVICES, pp=1, dp=1, precision="fp32",
                                sequence_parallel=False))
        split = sum(1 for v in plan.placements["params"].values() if "@tp" in v)
        source = describe_source(config)
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        port = free_port()
        procs = [ctx.Process(target=_rank, args=(r, port, results, source, plan.to_dict(),
                                                   program_text(plan, source), str(folder)))
                 for r in range(DEVICES)]
        for p in procs:
            p.start()
        rows = {}
        try:
            for _ in range(DEVICES):
                rank, row = results.get(timeout=1200)
                rows[rank] = row
        except queue.Empty:
            raise SystemExit("no result from the ranks in 20 minutes") from None
        finally:
            for p in procs:
                p.join(timeout=60)
                if p.is_alive():
                    p.kill()
        gib = 2**30
        print(f"\nmodel: {config} ({model_bytes / gib:.2f} GiB fp32 on disk), tp={DEVICES}, "
              f"{split} of {len(plan.placements['params'])} parameters split by the planner")
        print("| rank | RSS before MiB | peak RSS MiB | peak / model | read MiB | read / model "
              "| holds MiB | holds / model |")
        print("|---|---|---|---|---|---|---|---|")
        worst = 0.0
        for rank in sorted(rows):
            r = rows[rank]
            worst = max(worst, r["peak"] / model_bytes)
            print(f"| {rank} | {r['before'] / 2**20:.0f} | {r['peak'] / 2**20:.0f} | "
                  f"{r['peak'] / model_bytes:.1%} | {r['read'] / 2**20:.0f} | "
                  f"{r['read'] / model_bytes:.1%} | {r['local'] / 2**20:.0f} | "
                  f"{r['local'] / model_bytes:.1%} |")
        verdict = "PASS" if worst < LIMIT else "FAIL"
        print(f"\n{verdict}: the largest peak RSS is {worst:.1%} of the model's bytes "
              f"(limit {LIMIT:.0%})")
        if worst >= LIMIT:
            raise SystemExit(1)
    finally:
        if not args.keep and not args.folder:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
