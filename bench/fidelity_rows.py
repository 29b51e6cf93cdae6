"""Published runs for bench/scale_fidelity.py: the rows, their models, and one prediction each.

A row is predicted from its published configuration (pinned), then, optionally, planned freely
(the same engine and numerics, every parallel choice left to the search). Results are plain
dicts (no Plan objects), so rows can be predicted in worker processes (``predict_rows``).
"""

from __future__ import annotations

import copy
import hashlib
import multiprocessing
import os
import pickle
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch
import transformers
import yaml

import autopar
from autopar.cost.hardware import load_cluster
from autopar.errors import AutoparError
from autopar.models import build_model, token_inputs
from autopar.search.constraints import load_constraints

DATA = Path(__file__).resolve().parent / "data"
ROWS = DATA / "published_runs.yaml"


def load_rows(path: Path = ROWS) -> list[dict]:
    """The published runs, in file order."""
    return yaml.safe_load(path.read_text())["rows"]


# GPT-2's (and Megatron-LM's --hidden-dropout / --attention-dropout) default dropout: a row's
# model spec states ``dropout`` where its source trains with another (MPT: none)
GPT_DROPOUT = 0.1


def model_config(spec: dict) -> dict:
    """A Hugging Face config for a row's architecture: GPT rows as GPT-2 layers with a one-kernel
    tanh GELU (Megatron fuses bias and GELU), attention as the software that ran computed it,
    and the spec's ``dropout`` (default GPT-2's 0.1) on the embedding, attention and residual
    paths (each dropout keeps a 1-byte mask per element for the backward)."""
    if spec["arch"] == "gpt":
        dropout = float(spec.get("dropout", GPT_DROPOUT))
        return {"model_type": "gpt2", "n_embd": spec["hidden"], "n_layer": spec["layers"],
                "n_head": spec["heads"], "n_inner": spec["ffn"], "vocab_size": spec["vocab"],
                "n_positions": spec["seq"], "activation_function": "gelu_pytorch_tanh",
                "tie_word_embeddings": True, "dtype": "bfloat16",
                "attn_implementation": spec["attention"], "resid_pdrop": dropout,
                "embd_pdrop": dropout, "attn_pdrop": dropout}
    if spec["arch"] == "llama":
        return {"model_type": "llama", "attn_implementation": spec["attention"],
                "hidden_size": spec["hidden"],
                "num_hidden_layers": spec["layers"], "num_attention_heads": spec["heads"],
                "num_key_value_heads": spec["kv_heads"], "intermediate_size": spec["ffn"],
                "vocab_size": spec["vocab"], "max_position_embeddings": spec["seq"],
                "rope_theta": spec.get("rope_theta", 10000.0), "tie_word_embeddings": False,
                "dtype": "bfloat16"}
    raise ValueError(f"unknown arch {spec['arch']!r}")


def shape_key(spec: dict) -> str:
    """Rows with equal keys share one captured graph (a row's ``dropout`` is part of it)."""
    return repr(sorted(spec.items()))


_GRAPHS: dict[str, autopar.ir.Graph] = {}
# captured graphs kept on disk between runs (most of a run's time is capture); None: no disk cache
CACHE_DIR: Path | None = Path(os.environ.get("AUTOPAR_BENCH_CACHE",
                                             Path.home() / ".cache" / "autopar-bench" / "graphs"))
PACKAGE = Path(autopar.__file__).resolve().parent
# full-size configs of the bench's own rows that autopar does not ship (their capture is slow
# and only the bench needs them): one Hugging Face config.json per folder
MODELS_DIR = Path(__file__).resolve().parent / "data" / "models"


def _code_fingerprint() -> str:
    """What a captured graph depends on: the capture, IR and model code, the shipped configs,
    the bench's own configs (bench/data/models), torch and transformers. A change to any of
    them makes every cached graph stale."""
    digest = hashlib.sha256(f"{torch.__version__} {transformers.__version__}".encode())
    for root in [PACKAGE / sub for sub in ("capture", "ir", "models")] + [MODELS_DIR]:
        for path in sorted(root.rglob("*")):
            if path.suffix in (".py", ".json"):
                digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _capture(spec: dict) -> autopar.ir.Graph:
    if spec["arch"] == "shipped":
        return autopar.capture(spec["name"], seq=spec["seq"])
    if spec["arch"] == "folder":  # a Hugging Face config.json the bench keeps (bench/data/models)
        return autopar.capture(str(MODELS_DIR / spec["name"]), seq=spec["seq"])
    return autopar.capture(build_model(model_config(spec)), token_inputs(1, spec["seq"]))


def graph_of(spec: dict) -> autopar.ir.Graph:
    """The captured graph of a row's model: once per shape in this process, and from the disk
    cache (``CACHE_DIR``) when the same code captured it before. A spec's ``norm_kernel``
    (``fused_rmsnorm``: the run's RMSNorms were one fused kernel, e.g. torchtitan's
    ``norm_type = "fused_rmsnorm"``) is stated on a copy of the captured graph, which the
    activation count reads (autopar.cost.activations.fused_norm_saved)."""
    key = shape_key(spec)
    if key not in _GRAPHS and spec.get("norm_kernel"):
        graph = copy.copy(graph_of({k: v for k, v in spec.items() if k != "norm_kernel"}))
        graph.norm_kernel = spec["norm_kernel"]
        _GRAPHS[key] = graph
    if key not in _GRAPHS:
        cached = None
        if CACHE_DIR is not None:
            name = hashlib.sha256(f"{_code_fingerprint()} {key}".encode()).hexdigest()[:24]
            cached = CACHE_DIR / f"{name}.pkl"
        if cached is not None and cached.exists():
            _GRAPHS[key] = pickle.loads(cached.read_bytes())
        else:
            _GRAPHS[key] = _capture(spec)
            if cached is not None:
                cached.parent.mkdir(parents=True, exist_ok=True)
                partial = cached.with_suffix(f".{os.getpid()}.tmp")
                partial.write_bytes(pickle.dumps(_GRAPHS[key]))
                partial.replace(cached)  # atomic: a concurrent run never reads half a file
    return _GRAPHS[key]


def describe(plan: autopar.Plan) -> str:
    """A plan's configuration in one short line (mesh, ZeRO, micro-batches, schedule, ...)."""
    m = plan.mesh
    parts = [f"tp{m['tp']} pp{m['pp']} dp{m['dp']}" + (f" ep{m['ep']}" if m["ep"] > 1 else "")
             + (f" cp{m['cp']}" if m.get("cp", 1) > 1 else ""),
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


def _fastest(plan: autopar.Plan) -> float:
    """The fastest plan's step (the robust choice may trade up to 3% of it)."""
    return plan.solver.get("robust", {}).get("fastest_step_time_s", plan.predicted.step_time_s)


def _summary(plan: autopar.Plan) -> dict:
    return {"config": describe(plan), "step_s": plan.predicted.step_time_s,
            "fastest_s": _fastest(plan), "breakdown": dict(plan.predicted.breakdown),
            "fits": plan.predicted.memory["total"] <= plan.memory_limit_bytes,
            "tp": plan.mesh["tp"], "pp": plan.mesh["pp"], "dp": plan.mesh["dp"],
            "zero_stage": plan.zero_stage}


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def predict(row: dict, free: bool) -> dict:
    """Predict one row: ``status`` is ``priced`` (with ``pinned`` and ``error``, the throughput
    error published step / predicted step - 1) or ``not expressible`` (with ``reason``: what
    autopar said about the published configuration). A configuration over memory is still
    priced (the run happened) and flagged ``over_memory``."""
    out: dict = {"row": row, "status": "priced"}
    started = time.perf_counter()
    try:
        # an unknown constraint or engine is known before the (slow) capture
        load_constraints({k: ("full" if v == "every_other" else v)
                          for k, v in row["pins"].items()})
        graph = graph_of(row["model"])
        cluster = row["cluster"]
        if row.get("attention_kernel"):  # a fused kernel other than FlashAttention-2 ran
            cluster = load_cluster(cluster).with_attention_kernel(row["attention_kernel"])
        kwargs = dict(devices=row["devices"], cluster=cluster, global_batch=row["global_batch"])
        try:
            pinned = autopar.plan(graph, constraints=pins_for(row, graph), **kwargs)
        except autopar.InfeasibleError as exc:
            # the run happened, so its time is still predicted; the table says it does not fit
            out["over_memory"] = _one_line(exc)
            pinned = autopar.plan(graph, constraints=pins_for(row, graph), memory_limit_gb=1e6,
                                  **kwargs)
    except AutoparError as exc:
        out.pop("over_memory", None)  # not even without a memory bound: the reason is this one
        out.update(status="not expressible", reason=_one_line(exc))
        return out
    except Exception as exc:  # noqa: BLE001 - one row's failure must not stop the bench
        out.pop("over_memory", None)
        out.update(status="not expressible", reason=f"{type(exc).__name__}: {_one_line(exc)}")
        return out
    out["pinned"] = _summary(pinned)
    out["pinned_s"] = time.perf_counter() - started
    out["error"] = row["published_step_s"] / pinned.predicted.step_time_s - 1
    if free:
        same = {k: v for k, v in row["pins"].items() if k in ("engine", "precision")}
        started = time.perf_counter()
        try:
            out["free"] = _summary(autopar.plan(graph, constraints=same, **kwargs))
        except AutoparError as exc:
            out["free_failed"] = _one_line(exc)
        out["free_s"] = time.perf_counter() - started
    return out


def _predict_group(rows: list[dict], free: bool) -> list[dict]:
    return [predict(row, free) for row in rows]


def predict_rows(rows: list[dict], free: bool, jobs: int = 1, progress=None) -> list[dict]:
    """Predict every row, in ``jobs`` processes; rows of one model shape go to one process, so
    each shape is captured once. Results come back in the rows' order."""
    groups: dict[str, list[dict]] = {}
    for row in rows:
        groups.setdefault(shape_key(row["model"]), []).append(row)
    by_id: dict[str, dict] = {}
    if jobs <= 1:
        for group in groups.values():
            for row in group:
                if progress:
                    progress(row["id"])
                by_id[row["id"]] = predict(row, free)
    else:
        # fork: the workers inherit the imported modules; capture happens in the workers
        context = multiprocessing.get_context("fork")
        with ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool:
            # the largest groups first, so the pool ends together
            ordered = sorted(groups.values(), key=len, reverse=True)
            for group, results in zip(ordered, pool.map(_predict_group, ordered,
                                                        [free] * len(ordered)), strict=True):
                for row, res in zip(group, results, strict=True):
                    if progress:
                        progress(row["id"])
                    by_id[row["id"]] = res
    return [by_id[row["id"]] for row in rows]
