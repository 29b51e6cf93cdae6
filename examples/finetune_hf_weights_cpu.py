"""Real weights in and out on CPU: save a tiny Qwen2-MoE with ``save_pretrained`` (random
weights stand in for a downloaded checkpoint), plan it for 2 processes, train 3 steps from
those weights with ``autopar run --init-from`` (each rank reads only its slices), export the
latest checkpoint with ``autopar export --to hf``, and load the export with
``from_pretrained``.

Run: python examples/finetune_hf_weights_cpu.py [WORK_DIR]
"""

import json
import subprocess
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from autopar.models.hf import build_model

work = Path(sys.argv[1] if len(sys.argv) > 1 else "hf-weights-example")
source, art, exported = work / "qwen2-moe", work / "artifact", work / "exported"

torch.manual_seed(0)
build_model("tiny-qwen2-moe", device="cpu", dtype=torch.float32).save_pretrained(source)


def autopar(*args: str, procs: int = 0) -> None:
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                str(procs)] if procs else []
    subprocess.run([sys.executable, *launcher, "-m", "autopar", *args], check=True)


# a Hugging Face folder is a model too: its config.json is what is planned
autopar("compile", str(source), "--devices", "2", "--global-batch", "4", "--seq", "32",
        "--cluster", "cpu", "--constraints", "ep=2,zero_stage=2,precision=fp32",
        "--out", str(art), "-q")
autopar("run", str(art), "--steps", "3", "--device", "cpu", "--init-from", str(source),
        procs=2)
autopar("export", str(art), "--to", "hf", str(exported))

losses = [json.loads(line)["loss"] for line in (art / "logs" / "train.jsonl").open()]
model = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32)
ids = torch.randint(0, model.config.vocab_size, (1, 16))
with torch.no_grad():
    print(f"losses {[round(x, 4) for x in losses]}; the export loads and predicts "
          f"{tuple(model(ids).logits.shape)} logits")
print("files:", sorted(p.name for p in exported.iterdir()))
