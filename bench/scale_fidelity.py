"""Cost-model fidelity at scale: published training runs (8 to 16,384 GPUs) against autopar.

For every row of bench/data/published_runs.yaml: the published configuration, pinned (fields the
source does not give are left to the search), is predicted by the cost model; its step time is
set against the published one (converted as the row's notes say). Then the free plan for the
same model, devices and batch (the same engine and precision) is searched, and the table shows
whether it fits and how much faster than the pinned configuration it is predicted to be.

Every row names its source (bench/data/fidelity_sources.yaml). A source cited by a line of the
hardware catalog is in-sample (a catalog number was chosen by looking at it); the held-out
figures count only the other sources' rows (bench/fidelity_sources.py). A configuration autopar
cannot express yet (an engine or a constraint it lacks) is reported as "not expressible", with
autopar's reason, and counted as such.

Usage:
    python bench/scale_fidelity.py --jobs 2          # every row, two processes
    python bench/scale_fidelity.py --no-free         # the pinned predictions only
    python bench/scale_fidelity.py --rows korthikanti_175b_64gpu_sp_selective,bloom_176b_384gpu
    python bench/scale_fidelity.py --sources llm-foundry,nemo-h100 --no-free
    python bench/scale_fidelity.py --by-source       # per-source and leave-one-source-out tables
    python bench/scale_fidelity.py --markdown        # the tables as Markdown (for docs/)
"""

from __future__ import annotations

import argparse
import sys
import time

import fidelity_rows
from fidelity_rows import load_rows, predict_rows
from fidelity_sources import (
    WITHIN,
    by_source,
    catalog_citations,
    check_keys,
    counted,
    headline,
    load_sources,
)


def _pct(value: float | None, signed: bool = False) -> str:
    if value is None:
        return "-"
    return f"{value:+.1%}" if signed else f"{value:.1%}"


class Table:
    """Text or Markdown table printing."""

    def __init__(self, markdown: bool) -> None:
        self.md = markdown

    def head(self, cells: list[str]) -> None:
        self.line(cells)
        if self.md:
            print("|" + "---|" * len(cells))

    def line(self, cells: list[str]) -> None:
        sep = " | " if self.md else "  "
        if self.md:
            cells = [c.replace("|", "\\|") for c in cells]  # a bar inside a cell splits it
        print(("| " if self.md else "") + sep.join(cells) + (" |" if self.md else ""))


def difference(pinned: dict, free: dict) -> str:
    """The breakdown terms that differ most between the pinned and the free plan."""
    a, b = pinned["breakdown"], free["breakdown"]
    deltas = sorted(((a.get(k, 0) - b.get(k, 0), k) for k in set(a) | set(b)), reverse=True)
    return ", ".join(f"{k[:-2]} -{d:.3g}s" for d, k in deltas[:3] if d > 0)


def print_rows(results: list[dict], table: Table, free: bool) -> None:
    head = ["row", "source", "engine", "GPUs", "pinned configuration", "published",
            "pub. step s", "pred. step s", "error"]
    if free:
        head += ["free plan (chosen)", "chosen step s", "fastest step s", "fits",
                 "fastest vs pinned"]
    table.head(head)
    for res in results:
        row = res["row"]
        cells = [row["id"] + ("" if row["counted"] else " (apart)"), row["source_key"],
                 row["engine"], str(row["devices"])]
        if res["status"] != "priced":
            cells += ["not expressible: " + res["reason"][:90], row["published"],
                      f"{row['published_step_s']:.4g}", "-", "-"]
            table.line(cells + (["-"] * 5 if free else []))
            continue
        pinned = res["pinned"]
        over = " (over memory)" if "over_memory" in res else ""
        cells += [pinned["config"] + over, row["published"], f"{row['published_step_s']:.4g}",
                  f"{pinned['step_s']:.4g}", _pct(res["error"], signed=True)]
        if free and "free" in res:
            f = res["free"]
            cells += [f["config"], f"{f['step_s']:.4g}", f"{f['fastest_s']:.4g}",
                      "yes" if f["fits"] else "NO",
                      _pct(pinned["step_s"] / f["fastest_s"] - 1, signed=True)]
        elif free:
            cells += ["not planned: " + res.get("free_failed", "-")[:60]] + ["-"] * 4
        table.line(cells)


def _figure(name: str, s: dict) -> str:
    return (f"{name}: {s['rows']} rows ({s['priced']} priced, {s['not_expressible']} not "
            f"expressible); median |error| {_pct(s['median'])}, max {_pct(s['max'])}, within "
            f"{WITHIN:.0%}: {s['within']} of {s['priced']}"
            + (f" ({s['within'] / s['priced']:.0%})" if s["priced"] else ""))


def print_summary(results: list[dict], cited: dict[str, list[str]], free: bool) -> None:
    figures = headline(results, cited)
    rows = counted(results)
    priced = [r for r in rows if r["status"] == "priced"]
    devices = [r["row"]["devices"] for r in rows]
    sharded = [r for r in priced if r["pinned"]["zero_stage"] >= 1 and r["row"]["devices"] >= 256]
    three_d = [r for r in priced if r["pinned"]["tp"] > 1 and r["pinned"]["pp"] > 1
               and r["pinned"]["dp"] > 1 and r["row"]["devices"] >= 1000]
    print()
    print(f"counted rows: {len(rows)} from {figures['sources']['count']} sources; devices "
          f"{min(devices, default=0)} to {max(devices, default=0)}; sharded data parallel at "
          f">= 256 devices: {len(sharded)} rows; 3D at >= 1000 devices: {len(three_d)} rows")
    print("- " + _figure("all counted", figures["counted"]))
    print("- " + _figure("HELD-OUT (sources no catalog line cites)", figures["held_out"]))
    print("- " + _figure("in-sample (sources a catalog line cites)", figures["in_sample"]))
    print("- " + _figure("H100, all counted", figures["h100"]))
    print("- " + _figure("H100, held-out", figures["h100_held_out"]))
    print(f"- median of per-source medians: {_pct(figures['sources']['median_of_medians'])}")
    if priced:
        worst = max(priced, key=lambda r: abs(r["error"]))
        print(f"- largest |error|: {worst['row']['id']} {_pct(worst['error'], signed=True)}; "
              f"published configuration over memory: "
              f"{[r['row']['id'] for r in priced if 'over_memory' in r]}")
    if free and priced:
        planned = [r for r in priced if "free" in r]
        slower = [r for r in planned if r["free"]["fastest_s"]
                  > r["pinned"]["step_s"] * (1 + 1e-6)]
        unfit = [r for r in planned if not r["free"]["fits"] or "over_memory" in r]
        faster = [r for r in planned if r["pinned"]["step_s"] / r["free"]["fastest_s"] > 1.10]
        print(f"- fastest free plan slower than the published configuration: {len(slower)} "
              f"{[r['row']['id'] for r in slower]}; free plan or published configuration not "
              f"fitting: {len(unfit)}; free plan more than 10% faster: {len(faster)}")
        for r in faster:
            print(f"  {r['row']['id']}: {difference(r['pinned'], r['free'])}")


def print_not_expressible(results: list[dict], table: Table) -> None:
    missing = [r for r in counted(results) if r["status"] != "priced"]
    if not missing:
        return
    print()
    table.head(["not expressible", "source", "needs (row)", "autopar says"])
    for r in missing:
        table.line([r["row"]["id"], r["row"]["source_key"], r["row"].get("needs", "-"),
                    r["reason"][:160]])


def print_by_source(results: list[dict], cited: dict[str, list[str]], table: Table) -> None:
    entries = by_source(results, cited)
    print()
    table.head(["source", "rows", "priced", "not expressible", "median |error|", "max |error|",
                f"within {WITHIN:.0%}", "judged", "catalog lines citing it"])
    for s in entries:
        table.line([s["source"], str(s["rows"]), str(s["priced"]), str(s["not_expressible"]),
                    _pct(s["median"]), _pct(s["max"]), f"{s['within']}/{s['priced']}",
                    "held-out" if s["held_out"] else "IN-SAMPLE",
                    ", ".join(s["cited_by"][:4]) + (" ..." if len(s["cited_by"]) > 4 else "")
                    or "-"])
    print()
    table.head(["left out", "its rows' median |error|", "its rows within 25%",
                "counted in held-out figure", "held-out median without it"])
    for s in entries:
        table.line([s["source"], _pct(s["median"]), f"{s['within']}/{s['priced']}",
                    "yes" if s["held_out"] else "no (in-sample)",
                    _pct(s["held_out_median_without"])])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", help="comma-separated row ids (default: every row)")
    ap.add_argument("--sources", help="comma-separated source keys (default: every source)")
    ap.add_argument("--no-free", action="store_true", help="skip the free plans")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--by-source", action="store_true",
                    help="per-source and leave-one-source-out tables")
    ap.add_argument("--jobs", type=int, default=1,
                    help="worker processes (rows of one model shape share one)")
    ap.add_argument("--no-cache", action="store_true",
                    help="capture every model anew (default: captured graphs are kept in "
                         "$AUTOPAR_BENCH_CACHE or ~/.cache/autopar-bench, keyed by the capture "
                         "code, torch and transformers)")
    args = ap.parse_args()
    if args.no_cache:
        fidelity_rows.CACHE_DIR = None
    sources = load_sources()
    rows = load_rows()
    check_keys(rows, sources)
    if args.rows:
        wanted = set(args.rows.split(","))
        unknown = wanted - {r["id"] for r in rows}
        if unknown:
            ap.error(f"unknown row ids: {', '.join(sorted(unknown))}")
        rows = [r for r in rows if r["id"] in wanted]
    if args.sources:
        keys = set(args.sources.split(","))
        if keys - set(sources):
            ap.error(f"unknown sources: {', '.join(sorted(keys - set(sources)))}; "
                     f"use {', '.join(sources)}")
        rows = [r for r in rows if r["source_key"] in keys]
    free = not args.no_free
    started = time.perf_counter()
    results = predict_rows(rows, free, jobs=args.jobs,
                           progress=lambda rid: print(f"... {rid}", file=sys.stderr, flush=True))
    print(f"predicted {len(rows)} rows in {time.perf_counter() - started:.0f} s "
          f"({args.jobs} process{'es' if args.jobs > 1 else ''}); summed over rows: capture and "
          f"pinned plan {sum(r.get('pinned_s', 0) for r in results):.0f} s, free plans "
          f"{sum(r.get('free_s', 0) for r in results):.0f} s", file=sys.stderr)
    cited = catalog_citations(sources)
    table = Table(args.markdown)
    print_rows(results, table, free)
    print_summary(results, cited, free)
    print_not_expressible(results, table)
    if args.by_source:
        print_by_source(results, cited, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
