"""Cost-model fidelity at scale: published training runs (8 to 16,384 GPUs) against autopar.

For every row of bench/data/published_runs.yaml: the published configuration, pinned (fields the
source does not give are left to the search), is predicted by the cost model; its step time is
set against the published one (converted as the row's notes say). Then the free plan for the
same model, devices and batch (autopar's own engine and precision) is searched, and the table
shows whether it fits and how much faster than the pinned configuration it is predicted to be.

Usage:
    python bench/scale_fidelity.py                 # every row (about ten minutes on 2 cores)
    python bench/scale_fidelity.py --no-free       # the pinned predictions only
    python bench/scale_fidelity.py --rows korthikanti_175b_64gpu_sp_selective,bloom_176b_384gpu
    python bench/scale_fidelity.py --markdown      # the tables as Markdown (for docs/)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import yaml

import autopar
from autopar.models import build_model, token_inputs

ROWS = Path(__file__).resolve().parent / "data" / "published_runs.yaml"


def model_config(spec: dict) -> dict:
    """A Hugging Face config for a row's architecture: GPT rows as GPT-2 layers with a one-kernel
    tanh GELU (Megatron fuses bias and GELU), attention as the software that ran computed it."""
    if spec["arch"] == "gpt":
        return {"model_type": "gpt2", "n_embd": spec["hidden"], "n_layer": spec["layers"],
                "n_head": spec["heads"], "n_inner": spec["ffn"], "vocab_size": spec["vocab"],
                "n_positions": spec["seq"], "activation_function": "gelu_pytorch_tanh",
                "tie_word_embeddings": True, "dtype": "bfloat16",
                "attn_implementation": spec["attention"]}
    if spec["arch"] == "llama":
        return {"model_type": "llama", "attn_implementation": spec["attention"],
                "hidden_size": spec["hidden"],
                "num_hidden_layers": spec["layers"], "num_attention_heads": spec["heads"],
                "num_key_value_heads": spec["kv_heads"], "intermediate_size": spec["ffn"],
                "vocab_size": spec["vocab"], "max_position_embeddings": spec["seq"],
                "rope_theta": spec.get("rope_theta", 10000.0), "tie_word_embeddings": False,
                "dtype": "bfloat16"}
    raise ValueError(f"unknown arch {spec['arch']!r}")


_GRAPHS: dict[str, autopar.ir.Graph] = {}


def graph_of(spec: dict) -> autopar.ir.Graph:
    key = repr(sorted(spec.items()))
    if key not in _GRAPHS:
        if spec["arch"] == "shipped":
            _GRAPHS[key] = autopar.capture(spec["name"], seq=spec["seq"])
        else:
            model = build_model(model_config(spec))
            _GRAPHS[key] = autopar.capture(model, token_inputs(1, spec["seq"]))
    return _GRAPHS[key]


def describe(plan: autopar.Plan) -> str:
    m = plan.mesh
    parts = [f"tp{m['tp']} pp{m['pp']} dp{m['dp']}" + (f" ep{m['ep']}" if m["ep"] > 1 else "")
             + (f" cp{m['cp']}/{plan.cp_mode}" if m.get("cp", 1) > 1 else ""),
             f"z{plan.zero_stage}", f"mb{plan.microbatch_size}x{plan.num_microbatches}"]
    if m["pp"] > 1:
        parts.append(plan.schedule + (f"/v{plan.virtual_stages}" if plan.virtual_stages > 1
                                      else ""))
    if plan.sequence_parallel:
        parts.append("sp")
    modes = sorted(set(plan.recompute) - {"none"})
    if modes:
        parts.append("rc:" + "+".join(modes))
    if plan.offload:
        parts.append("off:" + "+".join(plan.offload))
    return " ".join(parts)


def pins_for(row: dict, graph: autopar.ir.Graph) -> dict:
    """The row's pins; ``every_other`` recompute (torchtitan's layer-level selective
    checkpointing) becomes full recompute of every second layer."""
    pins = dict(row["pins"])
    if pins.get("recompute") == "every_other":
        modes, count = [], 0
        for block in graph.blocks:
            if block.role == "layer":
                count += 1
                modes.append("full" if count % 2 == 0 else "none")
            else:
                modes.append("none")
        pins["recompute"] = modes
    return pins


def predict(row: dict, free: bool) -> dict:
    graph = graph_of(row["model"])
    kwargs = dict(devices=row["devices"], cluster=row["cluster"], global_batch=row["global_batch"])
    out: dict = {"row": row}
    started = time.perf_counter()
    try:
        pinned = autopar.plan(graph, constraints=pins_for(row, graph), **kwargs)
    except autopar.InfeasibleError as exc:
        # the run happened, so its time is still predicted; the table says it does not fit
        out["pinned_error"] = str(exc)
        try:
            pinned = autopar.plan(graph, constraints=pins_for(row, graph), memory_limit_gb=1e6,
                                  **kwargs)
        except (autopar.InfeasibleError, autopar.PlanError) as again:
            out["not_predicted"] = str(again)
            return out
    out["pinned"] = pinned
    out["pinned_s"] = time.perf_counter() - started
    published = row["published_step_s"]
    out["error"] = published / pinned.predicted.step_time_s - 1  # throughput error
    if free:
        # the same engine and numerics, every parallel choice free
        same = {k: v for k, v in row["pins"].items() if k in ("engine", "precision")}
        started = time.perf_counter()
        out["free"] = autopar.plan(graph, constraints=same, **kwargs)
        out["free_s"] = time.perf_counter() - started
    return out


def _fastest(plan: autopar.Plan) -> float:
    """The fastest plan's step (the robust choice may trade up to 3% of it)."""
    return plan.solver.get("robust", {}).get("fastest_step_time_s", plan.predicted.step_time_s)


def _terms(plan: autopar.Plan) -> dict[str, float]:
    return plan.predicted.breakdown


def difference(pinned: autopar.Plan, free: autopar.Plan) -> str:
    """The breakdown terms that differ most between the pinned and the free plan."""
    a, b = _terms(pinned), _terms(free)
    deltas = sorted(((a.get(k, 0) - b.get(k, 0), k) for k in set(a) | set(b)), reverse=True)
    return ", ".join(f"{k[:-2]} -{d:.3g}s" for d, k in deltas[:3] if d > 0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", help="comma-separated row ids (default: every row)")
    ap.add_argument("--no-free", action="store_true", help="skip the free plans")
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args()
    rows = yaml.safe_load(ROWS.read_text())["rows"]
    if args.rows:
        wanted = set(args.rows.split(","))
        rows = [r for r in rows if r["id"] in wanted]
    results = []
    for row in rows:
        print(f"... {row['id']}", file=sys.stderr, flush=True)
        results.append(predict(row, not args.no_free))
    md = args.markdown
    sep = " | " if md else "  "
    head = ["row", "engine", "GPUs", "pinned configuration", "published", "pub. step s",
            "pred. step s", "error"]
    if not args.no_free:
        head += ["free plan (chosen)", "chosen step s", "fastest step s", "fits",
                 "fastest vs pinned"]
    print(("| " if md else "") + sep.join(head) + (" |" if md else ""))
    if md:
        print("|" + "---|" * len(head))
    counted = []
    for res in results:
        row = res["row"]
        cells = [row["id"] + ("" if row["counted"] else " (apart)"), row["engine"],
                 str(row["devices"])]
        if "not_predicted" in res:
            cells += ["not predicted: " + res["not_predicted"][:70], row["published"],
                      f"{row['published_step_s']:.4g}", "-", "-"]
            print(("| " if md else "") + sep.join(cells) + (" |" if md else ""))
            continue
        pinned = res["pinned"]
        over = " (over memory)" if "pinned_error" in res else ""
        cells += [describe(pinned) + over, row["published"], f"{row['published_step_s']:.4g}",
                  f"{pinned.predicted.step_time_s:.4g}", f"{res['error']:+.1%}"]
        if "free" in res:
            free = res["free"]
            fastest = _fastest(free)
            gain = pinned.predicted.step_time_s / fastest - 1
            fits = free.predicted.memory["total"] <= free.memory_limit_bytes
            cells += [describe(free), f"{free.predicted.step_time_s:.4g}", f"{fastest:.4g}",
                      "yes" if fits else "NO", f"{gain:+.1%}"]
        if row["counted"]:
            counted.append(res)
        print(("| " if md else "") + sep.join(cells) + (" |" if md else ""))
    errors = [abs(r["error"]) for r in counted]
    sources = {r["row"]["source"].split(",")[0] for r in counted}
    devices = [r["row"]["devices"] for r in counted]
    sharded = [r for r in counted if r["pinned"].zero_stage >= 1 and r["row"]["devices"] >= 256]
    three_d = [r for r in counted if r["pinned"].mesh["tp"] > 1 and r["pinned"].mesh["pp"] > 1
               and r["pinned"].mesh["dp"] > 1 and r["row"]["devices"] >= 1000]
    print()
    print(f"counted rows: {len(counted)} from {len(sources)} sources; devices "
          f"{min(devices, default=0)} to {max(devices, default=0)}; sharded data parallel at "
          f">= 256 devices: {len(sharded)} rows; 3D at >= 1000 devices: {len(three_d)} rows")
    if errors:
        print(f"median |error| {statistics.median(errors):.1%}, max |error| {max(errors):.1%} "
              f"({max(counted, key=lambda r: abs(r['error']))['row']['id']}); rows beyond 25%: "
              f"{sum(e > 0.25 for e in errors)}")
    if not args.no_free and counted:
        slower = [r for r in counted if _fastest(r["free"])
                  > r["pinned"].predicted.step_time_s * (1 + 1e-6)]
        unfit = [r for r in counted if r["free"].predicted.memory["total"]
                 > r["free"].memory_limit_bytes or "pinned_error" in r]
        faster = [r for r in counted if r["pinned"].predicted.step_time_s
                  / _fastest(r["free"]) > 1.10]
        print(f"fastest free plan slower than the published configuration: {len(slower)} "
              f"{[r['row']['id'] for r in slower]}; free plan or published configuration not "
              f"fitting: {len(unfit)}; free plan more than 10% faster: {len(faster)}")
        for r in faster:
            print(f"  {r['row']['id']}: {difference(r['pinned'], r['free'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
