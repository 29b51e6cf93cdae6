"""An artifact directory as everything after codegen reads it: (manifest, plan) loaded and
checked (:func:`load_artifact`), the digests the manifest records, whether a program file is
as autopar wrote it for the plan (:func:`program_state`), and a program's text loaded as a
module (:func:`load_program`). Low in the house (above plan) so that codegen, which writes
artifacts, and the training, serving and calibration packages, which read them, share it
without the runtime importing codegen."""

from __future__ import annotations

import hashlib
import json
import types
from pathlib import Path

from autopar.artifact.swap import recover
from autopar.errors import PlanError
from autopar.plan import Plan

MANIFEST_VERSION = 2
PROGRAM_FILE = "train.py"  # the training program's name in an artifact


def digest(text: str | bytes) -> str:
    """sha256 of a file's text: the manifest records the plan's and the program's."""
    data = text.encode() if isinstance(text, str) else text
    return hashlib.sha256(data).hexdigest()


def program_state(directory: str | Path, name: str | None = None) -> str:
    """"generated" (the program, ``name`` or the manifest's, is as autopar wrote it for this
    plan.yaml), "stale" (plan.yaml changed since: regenerate), "edited" (the program was
    changed by hand: keep it), "missing" (no such file: regenerate)."""
    d = Path(directory)
    manifest = json.loads((d / "manifest.json").read_text())
    recorded = manifest.get("program", {})
    name = name or recorded.get("file", PROGRAM_FILE)
    path = d / name
    if not path.is_file():
        return "missing"
    if recorded.get("file", PROGRAM_FILE) != name:  # the plan's task asks for another program
        return "stale"
    if digest(path.read_bytes()) != recorded.get("sha256"):
        return "edited"
    if digest((d / "plan.yaml").read_bytes()) != recorded.get("plan_sha256"):
        return "stale"
    return "generated"


def load_program(text: str, filename: str = PROGRAM_FILE) -> types.ModuleType:
    """Execute program text as a module (not as ``__main__``) and return it."""
    module = types.ModuleType("autopar_program")
    module.__file__ = filename
    exec(compile(text, filename, "exec"), module.__dict__)  # noqa: S102 - the plan's program
    return module


def is_artifact(directory: Path) -> bool:
    """Whether ``directory`` is an autopar artifact: its manifest.json is a JSON object with
    an integer manifest version (any version: an older artifact is still ours to replace)."""
    try:
        manifest = json.loads((Path(directory) / "manifest.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(manifest, dict) and type(manifest.get("manifest_version")) is int


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
    recover(d)  # a compile killed mid-swap: the previous artifact is put back
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
