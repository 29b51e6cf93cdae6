"""A plan as a MindFormers training YAML's parallel sections, and such a YAML as constraints.

MindFormers (MindSpore) states parallelism in ``parallel_config`` (data_parallel,
model_parallel, pipeline_stage, expert_parallel, micro_batch_num, use_seq_parallel,
vocab_emb_dp), the optimizer shard in ``parallel.enable_parallel_optimizer`` (older YAMLs:
top-level ``optimizer_shard``), recompute in ``recompute_config`` (``recompute`` and
``select_recompute``: a switch, or one layer count per pipeline stage), the per-card
micro-batch in ``runner_config.batch_size``, and the model in ``model.model_config``.
The global batch it trains is data_parallel x micro_batch_num x batch_size (each 1 when
absent): the translation pins all three, so the file states its global batch.
"""

from __future__ import annotations

import math

from autopar.cost.precision import TORCH_DTYPE_NAMES
from autopar.plan.plan import Plan
from autopar.plan.support import refuse_op_recompute

# MindFormers names dtypes as torch does: bfloat16 -> bf16, ...
_DTYPES = {torch_name: short for short, torch_name in TORCH_DTYPE_NAMES.items()}


_CP_ALGOS = {"colossalai_cp": "ring", "ulysses_cp": "alltoall", "hybrid_cp": "hybrid"}


def is_mindformers(data: dict) -> bool:
    """Whether a loaded mapping is a MindFormers YAML (by its content)."""
    return "parallel_config" in data


def constraints_from_mindformers(data: dict, engine: str = "autopar") -> dict:
    """Constraint keys pinned by a MindFormers YAML, for a plan priced for ``engine``."""
    pc = data.get("parallel_config") or {}
    out: dict = {}
    for src, dst in (("data_parallel", "dp"), ("model_parallel", "tp"),
                     ("pipeline_stage", "pp"), ("expert_parallel", "ep"),
                     ("micro_batch_num", "num_microbatches"),
                     ("use_seq_parallel", "sequence_parallel"),
                     ("context_parallel", "cp")):
        if src in pc:
            out[dst] = pc[src]
    # absent, MindFormers keeps experts whole (expert_parallel 1): pinned, the file states its
    # data-parallel replicas and so its global batch
    ep = out.setdefault("ep", 1)
    if "dp" in out and isinstance(ep, int) and ep > 1 and isinstance(out["dp"], int):
        # MindFormers' expert_parallel splits the data-parallel ranks (device_num is
        # dp x mp x pp); autopar's ep is its own mesh axis beside dp, each seeing other data
        if out["dp"] % ep:
            raise ValueError(f"expert_parallel {ep} does not divide data_parallel "
                             f"{out['dp']}; MindFormers needs data_parallel to be a multiple "
                             f"of expert_parallel")
        out["dp"] //= ep
    batch = (data.get("runner_config") or {}).get("batch_size")
    # the global batch MindFormers trains: micro_batch_num micro-batches of batch_size per
    # data-parallel rank (absent, each is 1), so that planning without a global batch takes
    # the file's and a contradicting one is refused (default_global_batch)
    out["microbatch_size"] = batch if batch is not None else 1
    out.setdefault("num_microbatches", 1)
    # MindFormers' context_parallel_algo: colossalai_cp is a ring, ulysses_cp all-to-all,
    # hybrid_cp all-to-all inside a group and a ring across
    algo = _CP_ALGOS.get(str(pc.get("context_parallel_algo", "")))
    if algo and out.get("cp", 1) > 1:
        out["cp_mode"] = algo
    if out.get("pp", 1) > 1:  # MindSpore's pipeline runs 1F1B unless told to interleave
        pcfg = (data.get("parallel") or {}).get("pipeline_config") or {}
        if pcfg.get("pipeline_interleave"):
            out["schedule"] = "interleaved"
            if isinstance(pcfg.get("pp_interleave_num"), int):
                out["virtual_stages"] = pcfg["pp_interleave_num"]
        else:
            out["schedule"] = "1f1b"
    if "vocab_emb_dp" in pc:  # embedding table data-parallel: whole on every model-parallel rank
        out["vocab_parallel"] = not pc["vocab_emb_dp"]
    shard = (data.get("parallel") or {}).get("enable_parallel_optimizer",
                                               data.get("optimizer_shard"))
    if shard is not None:
        # MindSpore's optimizer parallel is ZeRO-1 (Megatron's distributed optimizer); under
        # model (tensor) parallelism autopar's own runtime shards parameters with FSDP2, so
        # the nearest stage it runs is 2; without optimizer sharding the stage is left to the
        # search there for the same reason
        tp = out.get("tp", 1)
        if shard:
            out["zero_stage"] = 1 if tp == 1 or engine != "autopar" else 2
        elif tp == 1 or engine != "autopar":
            out["zero_stage"] = 0
    model = (data.get("model") or {}).get("model_config") or {}
    shape = _shape(model)
    if shape:
        out["model"] = shape
    dtype = _DTYPES.get(str(model.get("compute_dtype", "")))
    if dtype:
        out["precision"] = dtype
    recompute = _recompute(data.get("recompute_config") or {}, shape.get("num_layers"),
                           out.get("pp", 1))
    if recompute is not None:
        out["recompute"] = recompute
    if data.get("offload"):
        out["offload"] = ["optimizer"]
    return out


def _shape(model: dict) -> dict:
    """The shape a ``model_config`` states, in autopar's words (plan.shape)."""
    out = {}
    for src, dst in (("hidden_size", "hidden_size"), ("num_layers", "num_layers"),
                     ("num_heads", "num_heads"), ("n_kv_heads", "num_kv_heads"),
                     ("vocab_size", "vocab_size"), ("seq_length", "seq_length"),
                     ("intermediate_size", "ffn_hidden_size")):
        if isinstance(model.get(src), int) and not isinstance(model.get(src), bool):
            out[dst] = model[src]
    if "num_heads" in out and "num_kv_heads" not in out and "n_kv_heads" in model:
        out["num_kv_heads"] = out["num_heads"]  # n_kv_heads: null means no grouping
    hidden, multiple = out.get("hidden_size"), model.get("multiple_of")
    if "ffn_hidden_size" not in out and hidden and isinstance(multiple, int):
        # MindFormers' LLaMA feed-forward width (LlamaFeedForward): 4h scaled by
        # ffn_dim_multiplier + 0.01, then 2/3 of it, rounded up to a multiple of multiple_of
        width = 4 * hidden
        if model.get("ffn_dim_multiplier"):
            width = int((float(model["ffn_dim_multiplier"]) + 0.01) * width)
        width = int(2 * width / 3)
        out["ffn_hidden_size"] = multiple * math.ceil(width / multiple)
    return out


def _recompute(rc: dict, layers: int | None, pp: int) -> str | tuple[str, ...] | None:
    """One mode for every block, or one per block (head, layers, tail) when the YAML gives
    per-stage layer counts: MindFormers recomputes the first n layers of each stage, the
    layers split evenly over the stages."""
    if not rc:
        return None
    full = rc.get("recompute_layers_per_stage", rc.get("recompute", False))
    selective = rc.get("select_recompute_layers_per_stage", rc.get("select_recompute", False))
    if not isinstance(full, list) and not isinstance(selective, list):
        return "full" if full else "selective" if selective else "none"
    if not layers:
        raise ValueError("recompute_config gives per-stage layer counts, but the YAML's "
                         "model.model_config has no num_layers to place them")
    per_stage = layers // pp
    modes = ["none"] * layers
    for kind, counts in (("selective", selective), ("full", full)):  # full wins
        if isinstance(counts, bool):
            counts = [per_stage if counts else 0] * pp
        if len(counts) != pp:
            raise ValueError(f"recompute_config lists {len(counts)} per-stage counts for "
                             f"pipeline_stage {pp}")
        for stage, n in enumerate(counts):
            for layer in range(stage * per_stage, stage * per_stage + min(int(n), per_stage)):
                modes[layer] = kind
    return ("none", *modes, "none")


def mindformers_yaml(plan: Plan) -> dict:
    """The parallel sections of a MindFormers training YAML for ``plan``."""
    refuse_op_recompute(plan, "MindFormers")
    m = plan.mesh
    layers = [(b.name, mode) for b, mode in zip(plan.model.blocks, plan.recompute, strict=True)
              if b.is_layer]
    modes = {mode for _, mode in layers}
    out = {
        "parallel_config": {"data_parallel": m["dp"] * m["ep"], "model_parallel": m["tp"],
                            "pipeline_stage": m["pp"], "expert_parallel": m["ep"],
                            "micro_batch_num": plan.num_microbatches,
                            "use_seq_parallel": bool(plan.sequence_parallel and m["tp"] > 1),
                            "vocab_emb_dp": not plan.model.get("vocab_parallel", True)},
        "parallel": {"enable_parallel_optimizer": plan.zero_stage >= 1},
        "runner_config": {"batch_size": plan.microbatch_size},
        "recompute_config": {"recompute": modes == {"full"},
                             "select_recompute": modes == {"selective"}},
    }
    if m.get("cp", 1) > 1:  # MindFormers' context parallelism and its algorithm
        algo = {v: k for k, v in _CP_ALGOS.items()}.get(plan.cp_mode)
        out["parallel_config"]["context_parallel"] = m["cp"]
        if algo:
            out["parallel_config"]["context_parallel_algo"] = algo
    if len(modes) > 1 and len(layers) % m["pp"] == 0:  # per-stage counts of leading layers
        per_stage = len(layers) // m["pp"]
        for kind, key in (("full", "recompute"), ("selective", "select_recompute")):
            if kind not in modes:
                continue
            out["recompute_config"][key] = [
                sum(1 for _, mode in layers[s * per_stage:(s + 1) * per_stage] if mode == kind)
                for s in range(m["pp"])]
    shape = plan.model.get("shape") or {}
    config = {dst: shape[src] for src, dst in (
        ("seq_length", "seq_length"), ("hidden_size", "hidden_size"),
        ("num_layers", "num_layers"), ("num_heads", "num_heads"),
        ("num_kv_heads", "n_kv_heads"), ("vocab_size", "vocab_size"),
        ("ffn_hidden_size", "intermediate_size")) if src in shape}
    compute = TORCH_DTYPE_NAMES.get(plan.training_precision.compute) if plan.precision else None
    if compute:
        config["compute_dtype"] = compute
    if config:
        out["model"] = {"model_config": config}
    return out
