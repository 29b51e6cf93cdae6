"""``autopar.compile``: write the runnable artifact directory for a plan.

DIR/plan.yaml      the plan
DIR/train.py       the training program generated from it (what ``autopar run DIR`` and
                   ``torchrun DIR/train.py`` execute); for a plan of task "infer",
DIR/generate.py    the generation program instead (``autopar run DIR --generate``)
DIR/manifest.json  how to rebuild the model on every rank, the world size, the library
                   versions, and the digests that tell a regenerated program from an edited one
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from autopar.artifact.load import (
    MANIFEST_VERSION,
    PROGRAM_FILE,
    digest,
    is_artifact,
    library_versions,
    program_state,
)
from autopar.artifact.swap import new_files_dir, recover, swap_in
from autopar.codegen.generate_program import GENERATE_FILE, generate_program_text
from autopar.codegen.program import program_text
from autopar.cost.engines import MEGATRON_ENGINES
from autopar.errors import PlanError
from autopar.files import fsync_dir, fsync_file
from autopar.models.source import describe_source
from autopar.plan import PLAN_VERSION, Plan
from autopar.plan.deepspeed import deepspeed_config
from autopar.plan.launch import devices_per_node
from autopar.plan.megatron import megatron_command
from autopar.plan.mindformers import mindformers_yaml
from autopar.plan.support import context_parallel_refusal


def program_file(plan: Plan) -> str:
    """The program an artifact of ``plan`` holds: generate.py to serve (task "infer"), else
    train.py."""
    return GENERATE_FILE if plan.task == "infer" else PROGRAM_FILE


def program_for(plan: Plan, source: dict) -> tuple[str, str]:
    """(file name, text) of the program generated for ``plan`` (``source``: the manifest's
    model recipe)."""
    if plan.task == "infer":
        return GENERATE_FILE, generate_program_text(plan, source)
    return PROGRAM_FILE, program_text(plan, source)


def edited_file(name: str) -> str:
    """Where re-compiling keeps a hand-edited ``name``: train.py -> train.edited.py."""
    return name.removesuffix(".py") + ".edited.py"


def compile_artifact(model: object, example_inputs: object, plan: Plan, out_dir: str | Path,
                     emit: tuple[str, ...] = ()) -> Path:
    """Write ``out_dir`` and return it. A new directory appears whole or not at all; in an
    existing artifact only the generated files are swapped (see
    :mod:`autopar.artifact.swap`): ``checkpoints/``, ``logs/`` and anything else
    there stay where they are, and an interrupted compile leaves the previous artifact.

    ``model`` is a shipped name / config path / ``module:factory`` string, or an nn.Module
    whose recipe can be recorded (a Hugging Face model, or one with a dataclass ``.cfg``).
    ``emit`` names other engines' formats to write beside the plan ("deepspeed"). A plan
    priced for another engine (``plan.engine`` megatron, megatron-core or deepspeed) gets that
    engine's file instead of ``train.py`` (llama3-4d: none): autopar's runtime does not run it. A plan of task "infer" gets
    ``generate.py``, the generation program, instead of ``train.py``.
    """
    plan.validate()
    cp_reason = context_parallel_refusal(plan.engine or "autopar", plan.mesh.get("cp", 1),
                                         plan.cp_mode)
    if cp_reason is not None:  # priced, not runnable: nothing is written
        raise PlanError(f"cannot compile a program that runs {cp_reason}")
    source = describe_source(model)
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise PlanError(f"{out} is a file; choose a new directory for --out")
    if out.is_dir() and any(out.iterdir()):
        recover(out, drop_unfinished=True)  # a compile killed mid-swap: its previous artifact
    if out.is_dir() and not is_artifact(out) and _holds_cwd(out):
        raise PlanError(f"--out {out_dir} is the current directory or one of its parents; "
                        f"choose a new directory for the artifact, such as --out art")
    if out.is_dir() and any(out.iterdir()):
        if not is_artifact(out):
            raise PlanError(f"{out} exists and is not an autopar artifact; choose an empty or "
                            f"new --out directory")
        new = new_files_dir(out)
        try:
            _write_files(new, plan, source, emit)
            old = _recorded_program(out)
            if (out / old).is_file() and program_state(out) == "edited":
                # a hand-edited program is the user's: it stays beside the new one
                shutil.copy(out / old, new / _free_name(out, edited_file(old)))
            swap_in(new, out)
        except BaseException:
            shutil.rmtree(new, ignore_errors=True)
            raise
        return out
    parent = out.parent if str(out.parent) else Path(".")
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=parent, prefix=f".{out.name}."))
    try:
        _write_files(tmp, plan, source, emit)
        for path in tmp.iterdir():
            fsync_file(path)
        os.replace(tmp, out)  # out is absent or an empty directory: one rename
        fsync_dir(parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _write_files(dest: Path, plan: Plan, source: dict, emit: tuple[str, ...]) -> None:
    """The generated files of ``plan``'s artifact, written into ``dest``."""
    plan.save(dest / "plan.yaml")
    manifest = {"manifest_version": MANIFEST_VERSION, "plan_version": PLAN_VERSION,
                "devices": plan.devices, "task": plan.task, "cluster": plan.cluster,
                "model": source, "versions": library_versions()}
    if plan.engine == "autopar":
        name, program = program_for(plan, source)
        (dest / name).write_text(program)
        manifest["program"] = {"file": name, "sha256": digest(program),
                               "plan_sha256": digest((dest / "plan.yaml").read_bytes())}
    else:  # a plan for another engine runs there: its launch file instead of a program
        emit = (*emit, "megatron" if plan.engine in MEGATRON_ENGINES else plan.engine)
    (dest / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    if "mindformers" in emit:  # a MindFormers YAML's parallel sections, on request
        import yaml

        (dest / "mindformers.yaml").write_text(yaml.safe_dump(mindformers_yaml(plan),
                                                              sort_keys=False))
    if "megatron" in emit:  # a Megatron-LM launch command, on request

        # nodes as the plan's cluster has them (unknown: one node of all the devices)
        per_node = devices_per_node(plan.cluster) or plan.devices
        (dest / "megatron.sh").write_text(megatron_command(plan, gpus_per_node=per_node))
    if "deepspeed" in emit:  # the plan in DeepSpeed's format, on request

        (dest / "deepspeed.json").write_text(json.dumps(deepspeed_config(plan), indent=2)
                                             + "\n")


def _holds_cwd(out: Path) -> bool:
    """Whether ``out`` is the current directory or one of its parents (writing an artifact
    there would mix it with whatever the user is working on)."""
    try:
        here, target = Path.cwd().resolve(), out.resolve()
    except OSError:
        return False
    return target == here or target in here.parents


def _free_name(directory: Path, name: str) -> str:
    """``name``, or ``stem.N.py`` when ``directory`` already holds it (an earlier edit kept
    by an earlier re-compile is not overwritten)."""
    stem, n = name.removesuffix(".py"), 2
    while (directory / name).exists():
        name, n = f"{stem}.{n}.py", n + 1
    return name


def _recorded_program(directory: Path) -> str:
    """The program file an existing artifact's manifest names (train.py when unreadable)."""
    try:
        manifest = json.loads((directory / "manifest.json").read_text())
        return str(manifest.get("program", {}).get("file", PROGRAM_FILE))
    except (OSError, ValueError, AttributeError):
        return PROGRAM_FILE


def regenerate_program(directory: str | Path, plan: Plan, manifest: dict, write: bool) -> str:
    """The program for the (edited) plan.yaml in ``directory``; with ``write``, also written
    to DIR/train.py (DIR/generate.py for task "infer") with the manifest's digests updated
    (atomically: one rank writes)."""
    d = Path(directory)
    file, program = program_for(plan, manifest["model"])
    if write:
        manifest = dict(manifest)
        manifest["program"] = {"file": file, "sha256": digest(program),
                               "plan_sha256": digest((d / "plan.yaml").read_bytes())}
        for name, text in ((file, program),
                           ("manifest.json", json.dumps(manifest, indent=2, sort_keys=True)
                            + "\n")):
            tmp = d / f".{name}.{os.getpid()}.tmp"  # one per writer (shared filesystems)
            tmp.write_text(text)
            os.replace(tmp, d / name)
    return program


