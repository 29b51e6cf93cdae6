"""A plan as a MindFormers training YAML's parallel sections, and such a YAML as constraints.

MindFormers (MindSpore) states parallelism in ``parallel_config`` (data_parallel,
model_parallel, pipeline_stage, expert_parallel, micro_batch_num, use_seq_parallel), the
optimizer shard in ``parallel.enable_parallel_optimizer`` (older YAMLs: top-level
``optimizer_shard``), recompute in ``recompute_config``, and the per-card micro-batch in
``runner_config.batch_size``.
"""

from __future__ import annotations

from autopar.plan.plan import Plan


def is_mindformers(data: dict) -> bool:
    """Whether a loaded mapping is a MindFormers YAML (by its content)."""
    return "parallel_config" in data


def constraints_from_mindformers(data: dict) -> dict:
    """Constraint keys pinned by a MindFormers YAML."""
    pc = data.get("parallel_config") or {}
    out: dict = {}
    for src, dst in (("data_parallel", "dp"), ("model_parallel", "tp"),
                     ("pipeline_stage", "pp"), ("expert_parallel", "ep"),
                     ("micro_batch_num", "num_microbatches"),
                     ("use_seq_parallel", "sequence_parallel")):
        if src in pc:
            out[dst] = pc[src]
    batch = (data.get("runner_config") or {}).get("batch_size")
    if batch:
        out["microbatch_size"] = int(batch)
    shard = (data.get("parallel") or {}).get("enable_parallel_optimizer",
                                               data.get("optimizer_shard"))
    if shard is not None:
        # MindSpore's optimizer parallel is ZeRO-1; under model (tensor) parallelism
        # autopar's runtime shards parameters with FSDP2, so the nearest stage it runs is 2;
        # without optimizer sharding the stage is left to the search for the same reason
        tp = out.get("tp", 1)
        if shard:
            out["zero_stage"] = 1 if tp == 1 else 2
        elif tp == 1:
            out["zero_stage"] = 0
    rc = data.get("recompute_config") or {}
    if rc:
        if rc.get("select_recompute"):
            out["recompute"] = "selective"
        else:
            out["recompute"] = "full" if rc.get("recompute") else "none"
    if data.get("offload"):
        out["offload"] = ["optimizer"]
    return out


def mindformers_yaml(plan: Plan) -> dict:
    """The parallel sections of a MindFormers training YAML for ``plan``."""
    m = plan.mesh
    modes = {mode for b, mode in zip(plan.model["blocks"], plan.recompute, strict=True)
             if b["name"] not in ("head", "tail", "root")}
    return {
        "parallel_config": {"data_parallel": m["dp"], "model_parallel": m["tp"],
                            "pipeline_stage": m["pp"], "expert_parallel": m["ep"],
                            "micro_batch_num": plan.num_microbatches,
                            "use_seq_parallel": bool(plan.sequence_parallel and m["tp"] > 1)},
        "parallel": {"enable_parallel_optimizer": plan.zero_stage >= 1},
        "runner_config": {"batch_size": plan.microbatch_size},
        "recompute_config": {"recompute": modes == {"full"},
                             "select_recompute": "selective" in modes},
    }
