"""The serving cost model against a public table of measured decode speeds.

bench/data/decode_speeds.yaml holds gpt-fast's published batch-1 decode speeds (Llama-2-7B and
-70B, bf16, tensor parallel 1 to 8 on A100-80GB). For each row, autopar plans the model as
the row ran it (task="infer", one sequence, the row's tensor-parallel degree pinned, caches
of 5 prompt + 200 new tokens) and the table sets the predicted tokens/s (one over the decoding
step) against the measured one. The measured figure also includes a 5-token prefill and
sampling; at 200 new tokens they are a small share.

Usage:
    python bench/decode_speed_table.py              # every row (about a minute on 2 cores)
    python bench/decode_speed_table.py --markdown   # the table as Markdown (for docs/)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

import autopar

TABLE = Path(__file__).resolve().parent / "data" / "decode_speeds.yaml"
TOLERANCE = 0.25  # the bar: every row within +-25%


def predicted_rows(table: dict) -> list[dict]:
    """Each measured row with autopar's prediction beside it."""
    graphs: dict[str, autopar.ir.Graph] = {}
    out = []
    for row in table["rows"]:
        name = row["config"]
        if name not in graphs:
            graphs[name] = autopar.capture(name, seq=table["context"])
        plan = autopar.plan(graphs[name], devices=row["tp"], cluster=table["cluster"],
                            task="infer", global_batch=row["batch"],
                            constraints={"tp": row["tp"], "pp": 1})
        predicted = row["batch"] / plan.predicted.decode_s_per_token
        out.append({**row, "predicted": predicted,
                    "error": predicted / row["measured"] - 1,
                    "decode_ms": plan.predicted.decode_s_per_token * 1e3,
                    "weights_gb": plan.predicted.memory["params"] / 1e9})
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    table = yaml.safe_load(TABLE.read_text())
    rows = predicted_rows(table)
    headers = ["model", "tp", "measured tok/s", "predicted tok/s", "error", "decode step",
               "weights/device"]
    cells = [[r["model"], str(r["tp"]), f"{r['measured']:.1f}", f"{r['predicted']:.1f}",
              f"{r['error']:+.1%}", f"{r['decode_ms']:.2f} ms", f"{r['weights_gb']:.1f} GB"]
             for r in rows]
    if args.markdown:
        print("| " + " | ".join(headers) + " |")
        print("|" + "---|" * len(headers))
        for c in cells:
            print("| " + " | ".join(c) + " |")
    else:
        widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(headers)]
        print("  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)))
        for c in cells:
            print("  ".join(v.rjust(w) if i > 1 else v.ljust(w)
                            for i, (v, w) in enumerate(zip(c, widths, strict=True))))
    errors = [abs(r["error"]) for r in rows]
    within = sum(e <= TOLERANCE for e in errors)
    print(f"\n{within}/{len(rows)} rows within +-{TOLERANCE:.0%}; largest error "
          f"{max(errors):.1%}; source: {table['source']['title']} ({table['cluster']}, "
          f"context {table['context']})")
    return 0 if within == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
