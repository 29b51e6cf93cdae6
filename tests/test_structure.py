"""The house: autopar's packages stand on floors, and imports only go down.

The floors are declared here, once (:data:`FLOORS`); docs/architecture.md draws the same list
and :func:`test_the_architecture_page_draws_these_floors` holds the two together. The import
graph is read from the code itself (ast over autopar/**/*.py), so a new import that climbs,
closes a circle or hides inside a function fails here with its file and line.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "autopar"

# lowest first; a package may import its own modules and any package on a lower floor. Packages
# on one floor stand beside each other and do not import each other.
FLOORS: tuple[tuple[str, ...], ...] = (
    ("errors", "files", "_paths", "_version"),  # foundation: no autopar imports of note
    ("models",),  # shipped configs, the plain GPT, where a model comes from (source)
    ("peft",),  # adapters as transforms of a model
    ("ir",),  # the graph
    ("capture",),  # model -> graph
    ("cost",),  # graph x parallel choice x hardware -> time and memory
    ("plan",),  # the Plan: data every later pass starts from
    ("search", "report", "artifact", "weights", "data", "metrics"),  # plan producers and readers
    ("calibrate",),  # measure, read traces, fit the cost model (replays the search)
    ("parallel",),  # apply a plan with PyTorch's distributed engine
    ("codegen",),  # the program that applies it, written from the plan
    ("train",),  # the Trainer, the launcher, autopar.parallelize
    ("serve",),  # generation, ONNX and Hugging Face export of a trained run
    ("api",),  # autopar.Trainer / TrainingArguments and the run config: the front door
    ("cli",),  # the autopar command
    ("autopar", "__main__"),  # the public names (autopar/__init__.py), python -m autopar
)

# imports that climb, each with why it is still there
UPWARD_ALLOWED: dict[tuple[str, str], str] = {}

# imports inside functions, (importing module, imported module) -> why not at the top
FUNCTION_IMPORTS_ALLOWED: dict[tuple[str, str], str] = {
    ("autopar.capture", "autopar.capture.onnx_import"):
        "onnx is optional: its importer loads only for a .onnx model",
    ("autopar.cli.export_cmd", "autopar.serve.onnx_decode"):
        "onnx, onnxruntime and transformers load only for export --to onnx",
}

MAX_SHARE = 0.25  # of autopar's lines, for any one package


@dataclass(frozen=True)
class Import:
    module: str  # the importing module, dotted
    target: str  # the imported module, dotted
    line: int
    in_function: bool


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_of(module: str) -> str:
    """The floor entry a dotted module belongs to: autopar.X[...] -> X; autopar -> autopar."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def internal_imports() -> list[Import]:
    """Every import of an autopar module in autopar/, relative ones resolved."""
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_name(path)
        tree = ast.parse(path.read_text(), str(path))
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = module.split(".")
                    if path.name != "__init__.py":
                        base = base[:-1]
                    base = base[:len(base) - (node.level - 1)]
                    targets = [".".join(base + ([node.module] if node.module else []))]
                else:
                    targets = [node.module or ""]
            else:
                continue
            scope, in_function = node, False
            while scope in parents and not in_function:
                scope = parents[scope]
                in_function = isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef))
            out += [Import(module, t, node.lineno, in_function) for t in targets
                    if t == "autopar" or t.startswith("autopar.")]
    return out


def floor_of() -> dict[str, int]:
    return {name: level for level, names in enumerate(FLOORS) for name in names}


def _where(imp: Import) -> str:
    return f"{imp.module} (line {imp.line}) imports {imp.target}"


def test_every_package_stands_on_a_floor() -> None:
    floors = floor_of()
    assert len(floors) == sum(len(f) for f in FLOORS), "a package is on two floors"
    packages = {package_of(_module_name(p)) for p in PACKAGE.rglob("*.py")}
    assert packages - set(floors) == set(), \
        "packages on no floor: add them to FLOORS (and to docs/architecture.md)"
    assert set(floors) - packages == set(), "FLOORS names packages that do not exist"


def test_imports_only_go_down() -> None:
    floors = floor_of()
    climbs = []
    for imp in internal_imports():
        src, dst = package_of(imp.module), package_of(imp.target)
        if src == dst or (src, dst) in UPWARD_ALLOWED:
            continue
        if src not in floors or dst not in floors:
            climbs.append(_where(imp) + " (a package on no floor)")
        elif floors[dst] >= floors[src]:
            climbs.append(_where(imp) + (" (same floor)" if floors[dst] == floors[src]
                                         else " (a higher floor)"))
    assert climbs == []


def test_no_circle_between_packages() -> None:
    graph = nx.DiGraph()
    for imp in internal_imports():
        src, dst = package_of(imp.module), package_of(imp.target)
        if src != dst and (src, dst) not in UPWARD_ALLOWED:
            graph.add_edge(src, dst)
    assert list(nx.simple_cycles(graph)) == []


def test_no_package_holds_more_than_a_quarter_of_the_lines() -> None:
    lines: dict[str, int] = {}
    for path in PACKAGE.rglob("*.py"):
        package = package_of(_module_name(path))
        lines[package] = lines.get(package, 0) + len(path.read_text().splitlines())
    total = sum(lines.values())
    over = {p: round(n / total, 3) for p, n in lines.items() if n > MAX_SHARE * total}
    assert over == {}


def test_imports_inside_functions_are_listed_with_a_reason() -> None:
    hidden = [imp for imp in internal_imports() if imp.in_function]
    unlisted = [_where(imp) for imp in hidden
                if (imp.module, imp.target) not in FUNCTION_IMPORTS_ALLOWED]
    assert unlisted == [], "import at the top, or list it here with why it cannot be"
    assert all(reason.strip() for reason in FUNCTION_IMPORTS_ALLOWED.values())


def test_the_architecture_page_draws_these_floors() -> None:
    """docs/architecture.md's floor diagram lists FLOORS top floor first, one line each."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = re.search(r"<!-- floors -->\n```\n(.*?)```", text, re.S)
    assert block is not None, "docs/architecture.md lost its floors block"
    drawn = [tuple(re.findall(r"[\w]+", line.split("|")[0])) for line in
             block.group(1).strip().splitlines()]
    assert drawn == list(reversed(FLOORS))
