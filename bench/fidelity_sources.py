"""Which published sources are in-sample, and the error figures per source, held out and in-sample.

A source is IN-SAMPLE when a catalog number was chosen by looking at it. That is decided
mechanically: every source in bench/data/fidelity_sources.yaml lists the strings that name it
(arXiv id, repository file, title), and any line of the hardware catalog (cost_models/*.yaml and
YAML data under autopar/) that contains one of them, case-insensitively, makes the source
in-sample; the tables name the catalog lines. Nothing in autopar is fitted to these rows
automatically, so leaving a source out means judging the cost model on the other sources only:
the held-out figures count the rows of held-out sources alone.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
SOURCES = Path(__file__).resolve().parent / "data" / "fidelity_sources.yaml"
# where catalog numbers live: the hardware catalog and any YAML data shipped in the package
CATALOG_GLOBS = ("cost_models/*.yaml", "autopar/**/*.yaml")
WITHIN = 0.25  # the bar: |error| within 25%


def load_sources(path: Path = SOURCES) -> dict[str, dict]:
    """Source key -> {title, url, identifiers}."""
    return yaml.safe_load(path.read_text())["sources"]


def catalog_citations(sources: dict[str, dict], root: Path = REPO,
                      globs: tuple[str, ...] = CATALOG_GLOBS) -> dict[str, list[str]]:
    """Source key -> the catalog lines (``file:line``) that name it; empty when held out."""
    cited: dict[str, list[str]] = {key: [] for key in sources}
    needles = {key: [s.lower() for s in src["identifiers"]] for key, src in sources.items()}
    files = sorted({f for pattern in globs for f in root.glob(pattern) if f.is_file()})
    for path in files:
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            low = line.lower()
            for key, strings in needles.items():
                if any(s in low for s in strings):
                    cited[key].append(f"{path.relative_to(root)}:{number}")
    return cited


def is_h100(row: dict) -> bool:
    """Rows on an H100 cluster (the issue counts them apart)."""
    return row["cluster"].startswith("h100")


def stats(results: list[dict]) -> dict:
    """Error figures over the priced rows of ``results`` (|error| median, max, share within 25%),
    with the counts of rows and of rows not expressible."""
    errors = [abs(r["error"]) for r in results if r["status"] == "priced"]
    return {"rows": len(results), "priced": len(errors),
            "not_expressible": sum(r["status"] != "priced" for r in results),
            "median": statistics.median(errors) if errors else None,
            "max": max(errors) if errors else None,
            "within": sum(e <= WITHIN for e in errors),
            "over_memory": sum("over_memory" in r for r in results if r["status"] == "priced")}


def counted(results: list[dict]) -> list[dict]:
    """The rows that count (``counted: true``), priced or not expressible."""
    return [r for r in results if r["row"]["counted"]]


def by_source(results: list[dict], cited: dict[str, list[str]]) -> list[dict]:
    """One entry per source with counted rows: its stats, whether it is held out, the catalog
    lines that cite it, and the held-out median without it (how much the held-out figure
    leans on that one source)."""
    rows = counted(results)
    keys = sorted({r["row"]["source_key"] for r in rows})
    held = [r for r in rows if not cited.get(r["row"]["source_key"])]
    table = []
    for key in keys:
        mine = [r for r in rows if r["row"]["source_key"] == key]
        others = stats([r for r in held if r["row"]["source_key"] != key])
        table.append({"source": key, **stats(mine), "held_out": not cited.get(key),
                      "cited_by": cited.get(key, []), "held_out_median_without": others["median"]})
    return table


def headline(results: list[dict], cited: dict[str, list[str]]) -> dict[str, dict]:
    """The figures the summary prints: all counted rows, held-out, in-sample, H100 (held-out
    and all), each as :func:`stats`; plus the median of per-source medians (each source
    weighs the same, however many rows it has)."""
    rows = counted(results)
    held = [r for r in rows if not cited.get(r["row"]["source_key"])]
    inside = [r for r in rows if cited.get(r["row"]["source_key"])]
    medians = [s["median"] for s in by_source(results, cited) if s["median"] is not None]
    return {"counted": stats(rows), "held_out": stats(held), "in_sample": stats(inside),
            "h100": stats([r for r in rows if is_h100(r["row"])]),
            "h100_held_out": stats([r for r in held if is_h100(r["row"])]),
            "sources": {"count": len({r["row"]["source_key"] for r in rows}),
                        "median_of_medians": statistics.median(medians) if medians else None}}


def check_keys(rows: list[dict], sources: dict[str, dict]) -> None:
    """Every row names a registered source (a ValueError naming the rows otherwise)."""
    bad = [r["id"] for r in rows if r.get("source_key") not in sources]
    if bad:
        raise ValueError(f"rows without a registered source_key (add it to {SOURCES.name}): "
                         + ", ".join(bad))
