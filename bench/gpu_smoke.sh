#!/usr/bin/env bash
# GPU smoke test (at most ~5 minutes on one GPU): measure the GPU with `autopar profile`, plan
# Llama-3.2-1B's shape (1.24B parameters, shipped as llama3-1b) for it in bf16, train the
# generated program 20 steps, and print the measured step time next to the prediction.
#
#   bash bench/gpu_smoke.sh [OUT_DIR]
#
# Env overrides (for a dry run of the plumbing on CPU: MODEL=tiny-llama DEVICE=cpu SEQ=32):
#   MODEL (llama3-1b)  DEVICE (cuda)  SEQ (2048)  BATCH (8)  STEPS (20)
set -euo pipefail
OUT=${1:-/tmp/autopar-gpu-smoke}
MODEL=${MODEL:-llama3-1b}
DEVICE=${DEVICE:-cuda}
SEQ=${SEQ:-2048}
BATCH=${BATCH:-8}
STEPS=${STEPS:-20}
PRECISION=$([ "$DEVICE" = cpu ] && echo fp32 || echo bf16)
rm -rf "$OUT" && mkdir -p "$OUT"

python -m autopar profile --quick --nprocs 1 --out "$OUT/machine.yaml" -q
python -m autopar compile "$MODEL" --devices 1 --cluster "$OUT/machine.yaml" --seq "$SEQ" \
  --global-batch "$BATCH" --constraints "precision=$PRECISION" --out "$OUT/art" -q > /dev/null
python -m autopar run "$OUT/art" --steps "$STEPS" --device "$DEVICE"

python - "$OUT/art" "$SEQ" <<'PY'
import json, statistics, sys
from pathlib import Path

import yaml

art, seq = Path(sys.argv[1]), int(sys.argv[2])
plan = yaml.safe_load((art / "plan.yaml").read_text())
rows = [json.loads(line) for line in (art / "logs" / "train.jsonl").read_text().splitlines()]
steps = [plan["global_batch"] * seq / r["tokens_per_s"] for r in rows[3:]]  # after warm-up
measured = statistics.median(steps)
predicted = plan["predicted"]["step_time_s"]
m = plan["mesh"]
print(f"model {plan['model']['params'] / 1e9:.2f}B params, mesh pp{m['pp']} dp{m['dp']} "
      f"tp{m['tp']}, precision {plan['precision']['compute']}, recompute "
      f"{sorted(set(plan['recompute']))}, micro-batch {plan['microbatch_size']} x "
      f"{plan['num_microbatches']}")
print(f"step time: measured {measured:.3f} s (median of {len(steps)}), predicted "
      f"{predicted:.3f} s, error {(predicted - measured) / measured:+.0%}")
print(f"peak memory: measured {rows[-1]['peak_memory_bytes'] / 2**30:.2f} GiB, predicted "
      f"{plan['predicted']['memory']['total'] / 2**30:.2f} GiB")
PY
