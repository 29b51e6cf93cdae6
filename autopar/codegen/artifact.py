"""``autopar.compile``: write the runnable artifact directory for a plan.

DIR/plan.yaml      the plan (the only thing the runtime reads to decide parallelism)
DIR/manifest.json  how to rebuild the model on every rank, the world size, versions
DIR/recipe.txt     what the runtime applies, module by module (for humans and diffs)
DIR/programs/      per pipeline stage: its ranks, its collectives each step, its FX code
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from autopar.errors import PlanError
from autopar.plan import PLAN_VERSION, Plan
from autopar.runtime.parallelize import data_parallel_wrapper
from autopar.runtime.source import describe_source

MANIFEST_VERSION = 1


def recipe_text(plan: Plan) -> str:
    """A readable account of what the runtime will do with this plan."""
    m = plan.mesh
    lines = [f"mesh (pp, dp, ep, tp) = ({m['pp']}, {m['dp']}, {m['ep']}, {m['tp']}) over "
             f"{plan.devices} ranks, tp innermost",
             f"batch: global {plan.global_batch} -> each data-parallel rank "
             f"{plan.microbatch_size} x {plan.num_microbatches} micro-batches",
             "weights: built on meta and parallelised there; each rank then allocates and "
             "initialises only its shards, one module at a time, seeded by (seed, module "
             "name), so every plan starts from one process's weights"]
    if m["pp"] > 1:
        v = plan.virtual_stages if plan.schedule == "interleaved" else 1
        lines.append(f"pipeline: torch.distributed.pipelining, {m['pp'] * v} chunks at blocks "
                     f"{plan.stages} (v={v}), schedule {plan.schedule}")
    offload = sorted({"optimizer", "params"} & set(plan.offload))
    wrapper = data_parallel_wrapper(plan)  # the runtime's own decision
    if wrapper == "fully_shard":
        lines.append(f"data parallel: fully_shard per layer and "
                     f"{'stage module' if m['pp'] > 1 else 'root'}, reshard_after_forward="
                     f"{plan.zero_stage == 3} (ZeRO-{plan.zero_stage})"
                     + (f", CPUOffloadPolicy ({'+'.join(offload)})" if offload else ""))
    elif wrapper == "ddp":
        zero1 = " + ZeroRedundancyOptimizer (ZeRO-1)" if plan.zero_stage == 1 else ""
        base = ("stage gradients averaged over dp after each step" if m["pp"] > 1
                else "DistributedDataParallel")
        lines.append(f"data parallel: {base}{zero1}")
    split = {k: v for k, v in plan.placements["params"].items() if "@tp" in v}
    if split:
        lines.append("tensor parallel (DTensor, parallelize_module):")
        for fqn, placement in sorted(split.items()):
            style = ("ColwiseParallel" if placement.startswith("Shard(0)") else "RowwiseParallel")
            lines.append(f"  {fqn:<48} {placement:<14} {style}")
    for block, mode in zip(plan.model["blocks"], plan.recompute, strict=True):
        if mode != "none":
            lines.append(f"recompute {mode:<9} {block['name']}")
    return "\n".join(lines) + "\n"


def compile_artifact(model: object, example_inputs: object, plan: Plan, out_dir: str | Path
                     ) -> Path:
    """Write ``out_dir`` (atomically: a failure leaves nothing behind) and return it.

    ``model`` is a shipped name / config path / ``module:factory`` string, or an nn.Module
    whose recipe can be recorded (a Hugging Face model, or one with a dataclass ``.cfg``).
    """
    plan.validate()
    source = describe_source(model)
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()) and not (out / "manifest.json").exists():
        raise PlanError(f"{out} exists and is not an autopar artifact; choose an empty or new "
                        f"--out directory")
    parent = out.parent if str(out.parent) else Path(".")
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=parent, prefix=f".{out.name}."))
    try:
        plan.save(tmp / "plan.yaml")
        manifest = {"manifest_version": MANIFEST_VERSION, "plan_version": PLAN_VERSION,
                    "devices": plan.devices, "task": plan.task, "cluster": plan.cluster,
                    "model": source, "versions": library_versions()}
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        (tmp / "recipe.txt").write_text(recipe_text(plan))
        from autopar.codegen.programs import program_dumps

        (tmp / "programs").mkdir()
        for name, text in program_dumps(source, plan).items():
            (tmp / "programs" / name).write_text(text)
        if out.exists():
            keep = out / "logs", out / "checkpoints"
            for item in keep:
                if item.exists():
                    shutil.move(str(item), tmp / item.name)
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def library_versions() -> dict[str, str]:
    """The torch and transformers releases this process plans with (local build tags such as
    "+cpu" or "+cu124" dropped: the same release on another device is the same program)."""
    import torch
    import transformers

    return {"torch": torch.__version__.split("+")[0],
            "transformers": transformers.__version__.split("+")[0]}


def check_versions(manifest: dict, where: str) -> None:
    """Refuse to run an artifact planned with other torch or transformers releases: module
    paths, traced graphs and init rules can differ between them."""
    recorded = manifest.get("versions")
    if not recorded:
        return  # artifacts written before versions were recorded
    here = library_versions()
    for lib, version in sorted(recorded.items()):
        if here.get(lib) != version:
            raise PlanError(f"{where} was planned with {lib} {version} but this is {lib} "
                            f"{here.get(lib)}; install {lib}=={version} or re-run autopar "
                            f"compile")


def load_artifact(directory: str | Path) -> tuple[dict, Plan]:
    """(manifest, plan) of an artifact directory, checked for version and consistency."""
    d = Path(directory)
    manifest_path = d / "manifest.json"
    if not manifest_path.is_file():
        raise PlanError(f"{d} is not an autopar artifact (no manifest.json); create one with "
                        f"`autopar compile MODEL --devices N --out {d}`")
    try:
        manifest = json.loads(manifest_path.read_text())
    except json.JSONDecodeError as exc:
        raise PlanError(f"{manifest_path} is corrupt ({exc.msg}); re-run autopar compile") \
            from None
    if manifest.get("manifest_version") != MANIFEST_VERSION:
        raise PlanError(f"{manifest_path} has manifest version "
                        f"{manifest.get('manifest_version')!r}, this autopar reads "
                        f"{MANIFEST_VERSION}; re-run autopar compile")
    check_versions(manifest, str(d))
    plan = Plan.load(d / "plan.yaml")
    if plan.devices != manifest.get("devices"):
        raise PlanError(f"{d}: plan.yaml is for {plan.devices} devices but the manifest says "
                        f"{manifest.get('devices')}; re-run autopar compile")
    return manifest, plan
