"""Fuzzing plan.yaml: a mutated plan file is refused in one line or trains like the original.

Seeded random mutations of plan files that ``autopar.plan`` emits (tiny-llama over tp=2 and
over pp=2): values replaced by other types, out-of-range numbers and hostile strings (quotes,
parentheses, line breaks, backslashes, triple quotes, a canary that creates a file if it ever
runs), keys removed and added, at the top level and nested. Each mutated file goes through
``Plan.load`` as a user's would, and then:

- refused: a PlanError of one line (a sample also through ``autopar report PLAN.yaml``: exit
  2, one line on stderr, nothing written);
- accepted: the program autopar generates for it must hold no call to ``open`` (nor
  ``system``, ``eval``, ...) and no trace of the canary; then it is compiled and imported as
  ``autopar run`` imports it, and no canary file may appear. And it must train exactly like
  the unmutated plan: the same program (byte for byte after its module docstring, the prose
  that states the predictions) and the same runtime fields (:data:`NOT_RUNTIME` lists what the
  runtime never reads), or, where they differ, a sample trains two steps on gloo ranks and
  its losses must equal the unmutated plan's (or the runtime refuses it in one line).
"""

from __future__ import annotations

import ast
import copy
import math
import os
import random
from pathlib import Path

import pytest
import yaml

import autopar
from autopar.codegen import compile_artifact, load_artifact, load_program
from autopar.codegen.artifact import program_for
from autopar.errors import PlanError
from autopar.plan import Plan

MUTATIONS_PER_BASE = 150  # two bases: 300 mutated plan files
CANARY = "CANARY"
# plan values that would create the canary file if any reached generated code unquoted: they
# close a docstring, a string of either quote, a call's parentheses or a line
CANARY_STRINGS = [
    f'x"""\nopen("{CANARY}", "w")\n"""',
    f"x'''\nopen('{CANARY}', 'w')\n'''",
    f'x")\nopen("{CANARY}", "w")\n#',
    f"x')\nopen('{CANARY}', 'w')\n#",
    f'open("{CANARY}", "w")',
    f"Shard(0)@tp)\nopen('{CANARY}', 'w')\n(",
    f"__import__('builtins').open('{CANARY}', 'w')",
    f'Replicate\\\nopen("{CANARY}", "w")',
]
HOSTILE_STRINGS = [
    "", " ", '"', "'", '"""', "'''", "(", ")", "x)", "Replicate)", "Shard(0)@tp)", "a\nb",
    "\\", "\\n", "a\\", "\r", "\t", "# comment", "null", "1", "2", "true", "${HOME}",
    "é", "a" * 400, "Shard(9)@tp", "Replicate@dp", "none", "full", "gpipe", "bf16",
]
OTHER_VALUES = [None, True, False, 0, 1, 2, 3, 4, -1, -2, 7, 10 ** 12, 2 ** 64, 1.5, -0.5, 0.0,
                math.nan, math.inf, -math.inf, [], {}, [1], [0, 1], [[0, 1]], {"a": 1},
                {"tp": 2}, ["none"], [1, 2, 3]]
EXTRA_KEYS = ["surprise", "__class__", "tp", "eval", CANARY_STRINGS[0], "params", "x.y"]
# subtrees whose every leaf would swamp the draw (the explain tables, per-node strategies,
# per-stage predictions): mutated as a whole, not leaf by leaf
COARSE = {("explain",), ("placements", "nodes_by_block_type"), ("predicted", "stages"),
          ("solver",), ("alternatives",)}
# fields the runtime never reads: the cost model's predictions and notes, the report's
# tables, the cost model's memory bound (advice in a failure line), the adapter count (a
# comment); model facts other than the inputs, outputs and blocks are the capture's notes
NOT_RUNTIME = {"predicted", "solver", "explain", "alternatives", "memory_limit_bytes",
               "trainable_params", "version"}
RUNTIME_MODEL_FACTS = {"inputs", "outputs", "input_dtypes", "blocks"}
_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)  # libyaml: 300 files in seconds
TRAINED_SAMPLE = 1  # accepted mutations that change runtime fields, trained for two steps
STEPS = 2


def runtime_fields(plan: Plan) -> dict:
    """What the runtime and codegen read of ``plan``: the plan file without :data:`NOT_RUNTIME`
    (found by reading autopar/runtime, autopar/codegen and autopar/cli/run_cmd.py, since split into
    autopar/parallel, autopar/train, autopar/serve and autopar/train/launch.py)."""
    data = plan.to_dict()
    for key in NOT_RUNTIME:
        data.pop(key, None)
    data["model"] = {k: v for k, v in data["model"].items() if k in RUNTIME_MODEL_FACTS}
    data["placements"] = {k: v for k, v in data["placements"].items()
                          if k != "nodes_by_block_type"}
    return data


def _paths(data: object, prefix: tuple = ()) -> list[tuple]:
    """Every path into ``data`` (dict keys and list indexes), whole :data:`COARSE` subtrees."""
    out = [prefix] if prefix else []
    if prefix in COARSE:
        return out
    if isinstance(data, dict):
        for key, value in data.items():
            out += _paths(value, (*prefix, key))
    elif isinstance(data, list):
        for i, value in enumerate(data):
            out += _paths(value, (*prefix, i))
    return out


def _at(data: object, path: tuple) -> object:
    for part in path:
        data = data[part]
    return data


def _hostile_value(rng: random.Random, old: object) -> object:
    roll = rng.random()
    if roll < 0.25:
        return rng.choice(CANARY_STRINGS)
    if roll < 0.5:
        string = rng.choice(HOSTILE_STRINGS)
        # a valid-looking value with something appended: the pattern checks must see the end
        return (old + string) if isinstance(old, str) and rng.random() < 0.5 else string
    if isinstance(old, bool) or not isinstance(old, int | float) or rng.random() < 0.5:
        return copy.deepcopy(rng.choice(OTHER_VALUES))
    return rng.choice([old + 1, old - 1, old * 2, -old, 0, float(old), str(old), old + 0.5])


def mutate(rng: random.Random, base: dict) -> tuple[str, dict]:
    """(what was done, a mutated deep copy of ``base``): one value replaced, a key or element
    removed, or a key added, at a random path (top level or nested)."""
    data = copy.deepcopy(base)
    # a top-level field first, then a path inside it: every field is drawn about as often
    # (drawn from all paths alike, the ~60 parameter placements would crowd out `cluster`)
    top = rng.choice(list(data))
    path = rng.choice([p for p in _paths(data) if p[0] == top])
    parent, key = _at(data, path[:-1]), path[-1]
    old = parent[key]
    roll = rng.random()
    if roll < 0.15:
        del parent[key]
        return f"removed {'.'.join(map(str, path))}", data
    if roll < 0.25:
        container = old if isinstance(old, dict) else parent
        if isinstance(container, dict):
            extra = rng.choice(EXTRA_KEYS)
            container[extra] = _hostile_value(rng, None)
            return f"added {extra!r} beside/under {'.'.join(map(str, path))}", data
        container.append(copy.deepcopy(container[-1]) if container and rng.random() < 0.5
                         else _hostile_value(rng, None))
        return f"appended to {'.'.join(map(str, path[:-1]))}", data
    if roll < 0.35 and isinstance(old, dict) and old:  # a key renamed (a hostile key)
        victim = rng.choice(list(old))
        old[rng.choice(EXTRA_KEYS[:2] + CANARY_STRINGS[:3] + HOSTILE_STRINGS[:12])] = \
            old.pop(victim)
        return f"renamed {'.'.join(map(str, (*path, victim)))}", data
    new = _hostile_value(rng, old)
    parent[key] = new
    return f"set {'.'.join(map(str, path))} = {new!r:.80}", data


def _calls_open(program: str) -> bool:
    tree = ast.parse(program)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else \
                func.attr if isinstance(func, ast.Attribute) else ""
            if name in ("open", "system", "__import__", "eval", "exec"):
                return True
    return False


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> list[dict]:
    """Two plans the planner emits (tiny-llama over tp=2 and over pp=2), each compiled into an
    artifact: its plan file's data, the Plan, the manifest's model source and the program."""
    graph = autopar.capture("tiny-llama", seq=32)
    out = []
    for name, pins in (("tp2", {"tp": 2}), ("pp2", {"pp": 2})):
        plan = autopar.plan(graph, devices=2, global_batch=4,
                            constraints=dict(pins, precision="fp32"))
        directory = compile_artifact("tiny-llama", None, plan,
                                     tmp_path_factory.mktemp(name) / "artifact")
        manifest, loaded = load_artifact(directory)
        data = yaml.safe_load((directory / "plan.yaml").read_text())
        out.append({"name": name, "data": data, "plan": loaded, "source": manifest["model"],
                    "program": program_for(loaded, manifest["model"]),
                    "runtime": runtime_fields(loaded)})
    return out


def _control_canary_would_fire(tmp_path: Path) -> None:
    """The canary is real: pasted unquoted into a docstring, it creates the file when run."""
    text = f'"""A docstring with {CANARY_STRINGS[0]} in it."""\n'
    assert _calls_open(text)
    exec(compile(text, "control.py", "exec"), {"open": lambda name, mode: open(  # noqa: S102
        tmp_path / name, mode)})
    assert (tmp_path / CANARY).exists()
    (tmp_path / CANARY).unlink()


def test_mutated_plans_are_refused_in_one_line_or_train_the_same(bases, tmp_path,
                                                                 monkeypatch) -> None:
    from tests.cli.test_inspect import _assert_one_line_error, cli_here

    _control_canary_would_fire(tmp_path)
    monkeypatch.chdir(tmp_path)  # a canary, if anything ran it, would land here
    cli_dir = tmp_path / "cli"
    cli_dir.mkdir()
    rng = random.Random(26)
    failures: list[str] = []
    counts = {"refused": 0, "same": 0, "changed": 0}
    changed: list[tuple[str, dict, Plan]] = []
    for base in bases:
        for _ in range(MUTATIONS_PER_BASE):
            what, data = mutate(rng, base["data"])
            case = f"{base['name']}: {what}"
            path = tmp_path / "plan.yaml"
            path.write_text(yaml.dump(data, Dumper=_DUMPER, sort_keys=False))
            loaded = False
            try:
                plan = Plan.load(path)
                loaded = True  # what is refused from here on needs the model: not `report`
                file, program = program_for(plan, base["source"])
            except PlanError as exc:
                counts["refused"] += 1
                if "\n" in str(exc) or "\r" in str(exc):
                    failures.append(f"{case}: a refusal of more than one line: {exc!r:.300}")
                if not loaded and counts["refused"] % 10 == 1:  # a sample through the CLI
                    (cli_dir / "plan.yaml").write_bytes(path.read_bytes())
                    before = sorted(os.listdir(cli_dir))
                    result = cli_here("report", str(cli_dir / "plan.yaml"))
                    try:
                        _assert_one_line_error(result)
                    except AssertionError:
                        failures.append(f"{case}: autopar report gave exit {result.returncode}"
                                        f", stderr {result.stderr!r:.300}")
                    if sorted(os.listdir(cli_dir)) != before:
                        failures.append(f"{case}: autopar report wrote files")
                continue
            except Exception as exc:  # noqa: BLE001 - the finding: not a one-line refusal
                failures.append(f"{case}: {type(exc).__name__}: {exc!r:.300}")
                continue
            if _calls_open(program) or CANARY in program:
                failures.append(f"{case}: the generated {file} holds the canary")
                continue  # never run what holds it
            load_program(program, file)  # compiled and imported, as `autopar run` does
            if (tmp_path / CANARY).exists():
                failures.append(f"{case}: the canary file appeared")
            same_code = file == base["program"][0] and \
                _body(program) == _body(base["program"][1])
            if same_code and runtime_fields(plan) == base["runtime"]:
                counts["same"] += 1
                continue
            counts["changed"] += 1
            changed.append((case, base, plan))
    assert not failures, f"{len(failures)} findings:\n" + "\n".join(failures)
    assert counts["refused"] >= 50 and counts["same"] >= 20, counts  # both outcomes exercised
    assert not (tmp_path / CANARY).exists()
    _train_a_sample(changed, failures)
    assert not failures, "\n".join(failures)



def _body(text: str) -> str:
    """A program without its module docstring: the prose that states the plan's predictions
    and cluster name; the code after it is what runs."""
    return text.split('"""', 2)[2]


def _train_plans(source: dict, plans: list[dict], steps: int) -> list:
    """On each rank of a gloo group: every plan of ``plans`` trained ``steps`` steps from the
    same seed, each by the program autopar generates for it; its losses, or the one-line
    PlanError the runtime refused it with."""
    from autopar.codegen import load_program, program_text
    from autopar.train import Trainer

    out = []
    for data in plans:
        try:
            plan = Plan.from_dict(data)
            trainer = Trainer(source, plan, program=load_program(program_text(plan, source)),
                              device="cpu", seed=0)
            out.append(trainer.train(steps))
        except PlanError as exc:  # all ranks refuse alike: the group stays in step
            out.append(f"refused: {exc}")
    return out


def _worker(rank: int, port: int, out, source: dict, plans: list[dict], steps: int) -> None:
    from tests.fixtures.harness import run_in_group

    run_in_group(rank, port, out, 2, _train_plans, source, plans, steps)


def _train_a_sample(changed: list, failures: list[str]) -> None:
    """Train each unmutated plan and a sample of the accepted mutations that change runtime
    fields (the first :data:`TRAINED_SAMPLE` of each base: CI time), all in one gloo group, and
    compare losses: equal to their base's, or refused by the runtime in one line."""
    from tests.fixtures.harness import spawn_ranks

    by_base: dict[str, list] = {}
    for case, base, plan in changed:
        picked = by_base.setdefault(base["name"], [base])
        if len(picked) <= TRAINED_SAMPLE:
            picked.append((case, plan))
    if not by_base:
        return
    plans = [plan.to_dict() for base, *sample in by_base.values()
             for plan in [base["plan"], *(p for _, p in sample)]]
    source = next(iter(by_base.values()))[0]["source"]  # both bases are tiny-llama
    results = iter(spawn_ranks(_worker, 2, (source, plans, STEPS), timeout_s=120)[0])
    for _, *sample in by_base.values():
        reference = next(results)
        for case, _ in sample:
            result = next(results)
            if isinstance(result, str):
                if "\n" in result:
                    failures.append(f"{case}: refused by the runtime in more than one line")
            elif result != pytest.approx(reference, rel=1e-5, abs=1e-5):
                failures.append(f"{case}: trains differently: losses {result} vs {reference}")
