"""Predicted vs measured MFU for the public torchtitan rows (64x A100-80G, FSDP2, bf16).

Usage: python bench/mfu_reference.py   (rows: tests/cost/data/torchtitan_a100.yaml)
"""

from __future__ import annotations

from pathlib import Path

import yaml

import autopar
from autopar.cost.config import ParallelConfig
from autopar.cost.estimate import estimate
from autopar.cost.hardware import load_cluster

ROWS = Path(__file__).resolve().parents[1] / "tests" / "cost" / "data" / "torchtitan_a100.yaml"
MODELS = {"llama3_8b": "llama3-8b", "llama3_70b": "llama3-70b", "llama2_13b": "llama2-13b",
          "llama2_70b": "llama2-70b"}
# torchtitan's layer-level selective checkpointing (selective_ac_option 2) recomputes every
# second layer in full; its op-level policy (saving every other matmul output and the
# attention output) is autopar's recompute mode "op"
RECOMPUTE = {"selective_layer": "every_other", "selective_op": "op", "full": "full",
             "none": "none"}


def per_block(graph: autopar.ir.Graph, mode: str) -> str | tuple[str, ...]:
    if mode != "every_other":
        return mode
    out, count = [], 0
    for block in graph.blocks:
        count += block.role == "layer"
        out.append("full" if block.role == "layer" and count % 2 == 0 else "none")
    return tuple(out)


def main() -> None:
    rows = yaml.safe_load(ROWS.read_text())["rows"]
    graphs: dict[tuple[str, int], autopar.ir.Graph] = {}
    print(f"{'row':<30} {'recompute':<15} {'pred MFU':>8} {'meas MFU':>8} {'error':>6} "
          f"{'pred tok/s/gpu':>14} {'meas':>6} {'pred mem GB':>11} fits")
    for row in rows:
        key = (MODELS[row["model"]["name"]], row["model"]["seq"])
        if key not in graphs:
            graphs[key] = autopar.capture(key[0], seq=key[1])
        cfg = row["config"]
        config = ParallelConfig(dp=64, zero_stage=3, microbatch_size=cfg["microbatch"],
                                recompute=per_block(graphs[key], RECOMPUTE[cfg["recompute"]]))
        est = estimate(graphs[key], "a100-80g", config)
        meas = row["measured"]
        fits = "yes" if est.fits(load_cluster("a100-80g").device.usable_memory_bytes) else "no"
        print(f"{row['id']:<30} {cfg['recompute']:<15} {est.mfu:>8.3f} {meas['mfu']:>8.3f} "
              f"{(est.mfu - meas['mfu']) / meas['mfu']:>+6.0%} {est.tokens_per_s / 64:>14.0f} "
              f"{meas['tokens_per_s_per_gpu']:>6} {est.memory.total / 1e9:>11.1f} {fits}")


if __name__ == "__main__":
    main()
