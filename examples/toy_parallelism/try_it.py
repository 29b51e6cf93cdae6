"""Add the toy parallelism of docs/architecture.md to a copy of autopar, and use it.

    python examples/toy_parallelism/try_it.py DIR

1. Copies the installed autopar package into DIR/autopar (with its catalogs, as a wheel holds
   them), so nothing installed changes.
2. Adds the toy: its cost and capability (cost/last_layer_gathered.py), its runtime
   (parallel/last_layer_gathered.py) and the registry's two lines (plan/parallelisms.py), then
   prints every file of the copy that differs from the package: those three.
3. With DIR first on the path: plans tiny Llama for 2 CPU processes at ZeRO-3, where the
   search chooses the toy, and with the toy pinned off; compiles both (one train.py calls the
   toy's apply); trains each 3 steps under torchrun and prints the losses, which agree: the
   toy changes when parameters are gathered, not what is computed.
"""

from __future__ import annotations

import filecmp
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

import autopar
from autopar._paths import data_dir

HERE = Path(__file__).resolve().parent
# the registry's two lines: an import among plan/parallelisms.py's imports, an entry in its list
IMPORT = "from autopar.cost import last_layer_gathered\n"
ENTRY = '''\
    Parallelism("last_layer_gathered", (False, True), "autopar.parallel.last_layer_gathered",
                last_layer_gathered.supported, last_layer_gathered.price,
                "keep the last layer gathered from its forward to its backward"),
'''
PLAN = ["tiny-llama", "--devices", "2", "--seq", "32", "--global-batch", "4", "--cluster", "cpu",
        "-q"]
PINS = "dp=2,zero_stage=3,precision=fp32"


def add_toy(package: Path) -> list[str]:
    """Copy the toy into ``package`` (a copy of autopar) and return what now differs from the
    installed package, file by file."""
    shutil.copy(HERE / "cost" / "last_layer_gathered.py", package / "cost")
    shutil.copy(HERE / "parallel" / "last_layer_gathered.py", package / "parallel")
    registry = package / "plan" / "parallelisms.py"
    text = registry.read_text()
    text = text.replace("from autopar.errors import PlanError\n",
                        IMPORT + "from autopar.errors import PlanError\n", 1)
    text = text.replace("PARALLELISMS: list[Parallelism] = [\n",
                        "PARALLELISMS: list[Parallelism] = [\n" + ENTRY, 1)
    registry.write_text(text)
    return differing(Path(autopar.__file__).parent, package)


def differing(original: Path, copy: Path) -> list[str]:
    """Paths (relative) of .py files added to or changed in ``copy``."""
    out = []
    for path in sorted(copy.rglob("*.py")):
        rel = path.relative_to(copy)
        before = original / rel
        if not before.is_file() or not filecmp.cmp(before, path, shallow=False):
            out.append(str(rel))
    return out


def _run(args: list[str], env: dict, cwd: Path) -> subprocess.CompletedProcess:
    # cwd: python -m puts the working directory first on the path, before PYTHONPATH
    result = subprocess.run(args, env=env, cwd=cwd, capture_output=True, text=True,
                            timeout=300)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(args[:4])} ... failed:\n{result.stderr[-3000:]}")
    return result


def main(directory: Path) -> None:
    package = directory / "autopar"
    shutil.rmtree(package, ignore_errors=True)
    shutil.copytree(Path(autopar.__file__).parent, package,
                    ignore=shutil.ignore_patterns("__pycache__", "_data"))
    for name in ("cost_models", "strategies"):
        shutil.copytree(data_dir(name), package / "_data" / name)
    print("files the toy adds or changes:", ", ".join(add_toy(package)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(directory), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    losses = {}
    for label, pins in (("toy chosen", PINS), ("toy off", PINS + ",last_layer_gathered=false")):
        art = directory / label.replace(" ", "-")
        _run([sys.executable, "-m", "autopar", "compile", *PLAN, "--constraints", pins,
              "--out", str(art)], env, directory)
        # the plan as plain data: this process's autopar (the installed one) has no toy
        plan = yaml.safe_load((art / "plan.yaml").read_text())
        program = (art / "train.py").read_text()
        calls = [line.strip() for line in program.splitlines() if ".apply(" in line]
        print(f"{label}: parallelisms {plan.get('parallelisms', {})}, predicted step "
              f"{plan['predicted']['step_time_s']:.4g} s, train.py calls {calls or 'no toy'}")
        _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
              "2", str(art / "train.py"), "--steps", "3", "--device", "cpu"], env, directory)
        records = (art / "logs" / "train.jsonl").read_text().splitlines()
        losses[label] = [round(json.loads(r)["loss"], 5) for r in records]
        print(f"{label}: losses {losses[label]}")
    print("same losses:", losses["toy chosen"] == losses["toy off"])


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python examples/toy_parallelism/try_it.py DIR")
    main(Path(sys.argv[1]).resolve())
