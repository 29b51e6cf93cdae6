"""Serve a generation artifact (compiled with ``--task infer``) with its own program: what
``autopar run DIR --generate`` runs, and what a generated generate.py run as a script
(``torchrun DIR/generate.py --prompts FILE``) calls, so both read the same options and check
the same inputs."""

from __future__ import annotations

import os

from autopar.artifact import load_artifact
from autopar.data.instruction import load_hf_tokenizer
from autopar.errors import PlanError
from autopar.plan.support import refuse_unsupported
from autopar.serve.generate import check_sampling, check_servable, serve, serving_model
from autopar.serve.prompts import print_generated, read_prompts
from autopar.train.launch import join_job, run_program, teardown
from autopar.train.options import RunOptions
from autopar.train.trainer import run_device


def serve_artifact(options: RunOptions, manifest: dict | None = None, plan=None) -> None:
    """Serve the prompts of ``options`` with the artifact in ``options.directory`` (its
    ``manifest`` and ``plan``, loaded and checked when not given): every input checked first,
    then DIR/generate.py (regenerated, or kept as edited) under the plan's processes; rank 0
    prints one JSON line per prompt."""
    directory, generation = options.directory, options.generation
    if manifest is None or plan is None:
        manifest, plan = load_artifact(directory)
        refuse_unsupported(plan)
    if options.resume or options.init_from:
        raise PlanError("--resume and --init-from are for training; --generate serves the "
                        "artifact's latest checkpoint: drop them")
    if plan.task != "infer":
        raise PlanError(f"{directory} was compiled for --task {plan.task}; --generate serves an "
                        f"artifact compiled with --task infer (autopar compile MODEL --task "
                        f"infer --out DIR), or generate from this one with autopar generate "
                        f"{directory} --prompts FILE")
    if generation.prompts is None:
        raise PlanError(f"{directory} is a serving artifact (compiled with --task infer) and "
                        f"needs prompts: autopar run {directory} --generate --prompts FILE")
    check_servable(plan, manifest["model"])
    check_sampling(generation.max_new_tokens, generation.sample, generation.temperature,
                   generation.top_k, generation.top_p)
    tok = None
    if generation.tokenizer is not None:
        tok = load_hf_tokenizer(generation.tokenizer)
    ids = read_prompts(generation.prompts, tok)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    plan.check_world_size(world)
    program = run_program(directory, manifest, plan,
                          needs=("build_mesh", "parallelize", "generate"))
    kind = join_job(plan.cluster, options.device, world, options.timeout_s)
    finished = False
    try:
        model = serving_model(directory, run_device(kind))
        rows, seconds = serve(program, model, ids, device=kind,
                              **generation.decoding(options.seed))
        finished = True
    finally:
        teardown(world, finished)
    if int(os.environ.get("RANK", "0")) == 0:
        print_generated(rows, tok, seconds)
