"""Readable per-stage programs: which ranks run a stage, the collectives it performs each step,
and its FX code (traced on the meta device, split at the plan's stage boundaries)."""

from __future__ import annotations

import torch

from autopar.plan import Plan


def stage_ranks(plan: Plan, chunk: int) -> list[int]:
    """Global ranks that run pipeline chunk ``chunk`` (mesh order pp, dp, ep, tp)."""
    m = plan.mesh
    pp_index = chunk % m["pp"]
    per_stage = m["dp"] * m["ep"] * m["tp"]
    return list(range(pp_index * per_stage, (pp_index + 1) * per_stage))


def _collectives(plan: Plan, module_paths: set[str], chunk: int, chunks: int) -> list[str]:
    m, out = plan.mesh, []
    for fqn, placement in sorted(plan.placements["params"].items()):
        path = fqn.rsplit(".", 1)[0]
        if "@tp" not in placement or path not in module_paths or not fqn.endswith("weight"):
            continue
        if placement.startswith("Shard(1)"):
            out.append(f"all_reduce over tp({m['tp']}) of {path}'s output (forward)")
        else:
            out.append(f"all_reduce over tp({m['tp']}) of {path}'s input gradient (backward)")
    replicas = m["dp"] * m["ep"]
    if replicas > 1:
        z = plan.zero_stage
        out.append({0: f"all_reduce of gradients over dp({replicas}) after the backward",
                    1: f"all_reduce of gradients over dp({replicas}); optimizer states sharded",
                    2: f"reduce_scatter of gradients over dp({replicas}); all_gather of updated "
                       f"parameters",
                    3: f"all_gather of each layer's parameters over dp({replicas}) before its "
                       f"forward and backward; reduce_scatter of its gradients"}[z])
    if chunks > 1:
        if chunk > 0:
            out.append("recv activations from the previous stage; send their gradients back")
        if chunk < chunks - 1:
            out.append("send activations to the next stage; recv their gradients")
    return out


def program_dumps(source: dict, plan: Plan) -> dict[str, str]:
    """File name -> text, one per pipeline chunk."""
    from torch.distributed.pipelining import pipeline

    from autopar.runtime.pipeline import chunk_ranges, split_spec
    from autopar.runtime.source import build_from_source

    seq = next(iter(plan.model["inputs"].values()))[1]
    model = build_from_source(source, seed=0, device="meta")
    example = torch.zeros(plan.microbatch_size, seq, dtype=torch.long, device="meta")
    kwargs = {"use_cache": False} if hasattr(model, "config") else None
    chunks = chunk_ranges(plan) if plan.mesh["pp"] > 1 else [(0, len(plan.model["blocks"]))]
    spec = split_spec(plan, chunks, model) if len(chunks) > 1 else {}
    pipe = pipeline(model, mb_args=(example,), mb_kwargs=kwargs, split_spec=spec)
    files = {}
    for i in range(pipe.num_stages):
        module = pipe.get_stage_module(i)
        paths = {n for n, _ in module.named_modules()}
        start, end = chunks[i]
        names = [b["name"] for b in plan.model["blocks"][start:end]]
        lines = [f"# stage {i} of {pipe.num_stages}: blocks {start}-{end - 1} "
                 f"({names[0]} .. {names[-1]})",
                 f"# runs on ranks {stage_ranks(plan, i)}",
                 "# collectives each step:"]
        lines += [f"#   {c}" for c in _collectives(plan, paths, i, pipe.num_stages)] or \
            ["#   none"]
        lines += ["", "# stage program", module.code.strip(), ""]
        shown: set[str] = set()
        for name, sub in module.named_modules():
            if not name or name.count(".") > 3 or not isinstance(getattr(sub, "graph", None),
                                                                 torch.fx.Graph):
                continue
            code = sub.graph.python_code(root_module="self").src
            key = code.strip()
            if key in shown:  # repeated layers print once
                continue
            shown.add(key)
            lines += [f"# module {name} ({type(sub).__name__})", key, ""]
        files[f"stage{i}.py.txt"] = "\n".join(lines) + "\n"
    return files
