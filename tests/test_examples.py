"""The examples run as a user runs them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def run(script: str, *args: str) -> str:
    result = subprocess.run([sys.executable, str(EXAMPLES / script), *args],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_capture_llama_example() -> None:
    out = run("capture_llama.py", "tiny-llama", "64")
    assert "4 x transformer" in " ".join(out.split())
    assert "q_proj" in out


def test_estimate_llama_example() -> None:
    out = run("estimate_llama.py")
    lines = [ln for ln in out.splitlines() if "x 64" in ln or "TP" in ln]
    assert len(lines) == 5
    assert "DDP x 64, full recompute" in out and "NO" in out  # 128 GB of model states


def test_plan_llama_example(tmp_path) -> None:
    result = subprocess.run([sys.executable, str(EXAMPLES / "plan_llama.py")], cwd=tmp_path,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "runner-ups" in result.stdout and "pinned tp=8" in result.stdout
    assert (tmp_path / "llama3-70b.plan.yaml").is_file()


def test_train_gpt_cpu_example(tmp_path) -> None:
    out = tmp_path / "art"
    result = subprocess.run([sys.executable, str(EXAMPLES / "train_gpt_cpu.py"), str(out)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "def parallelize_stage(" in (out / "train.py").read_text()  # a pipeline program
    assert len((out / "logs" / "train.jsonl").read_text().splitlines()) == 10


def test_trainer_quickstart_example(tmp_path) -> None:
    result = subprocess.run([sys.executable, str(EXAMPLES / "trainer_quickstart.py"),
                             str(tmp_path / "run")], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "'eval_perplexity'" in result.stdout
    assert len((tmp_path / "run" / "logs" / "train.jsonl").read_text().splitlines()) == 10


def test_train_mixtral_ep_cpu_example(tmp_path) -> None:
    out = tmp_path / "art"
    result = subprocess.run([sys.executable, str(EXAMPLES / "train_mixtral_ep_cpu.py"), str(out)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "ep=2" in result.stdout and result.stdout.count("one process") == 4
    assert len((out / "logs" / "train.jsonl").read_text().splitlines()) == 4


def test_plan_at_scale_example() -> None:
    out = run("plan_at_scale.py", "--devices", "256", "--global-batch", "256")
    rows = [ln for ln in out.splitlines() if ln.startswith(("free plan", "ZeRO-3 only", "tp 8"))]
    assert len(rows) == 3
    free, *others = (float(r.split()[-4]) for r in [rows[0]] + rows[1:])  # step s column
    assert all(free <= o * 1.03 for o in others)  # the robust choice is within 3% of the best
    assert "chosen among" in out and "compute" in out


@pytest.mark.dist
def test_parallelize_your_own_loop_example() -> None:
    """A ViT classifier planned by autopar.plan and trained by its own loop (own loss,
    DataLoader) after autopar.parallelize: dp2 ZeRO-3 and tp2 print one process's losses."""
    script = str(EXAMPLES / "parallelize_vit.py")

    def losses(*command: str) -> list[float]:
        result = subprocess.run(list(command), capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-2000:]
        return [float(line.split()[-1]) for line in result.stdout.splitlines()
                if line.startswith("step")]

    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", "2"]
    single = losses(sys.executable, script)
    assert len(single) == 5
    # tp=2 planned for GPUs splits every nn.TransformerEncoderLayer (run from its graph)
    for args in (("dp=2,zero_stage=3",), ("tp=2", "a100-80g")):
        assert losses(*torchrun, script, *args) == pytest.approx(single, rel=1e-5), args


def test_finetune_hf_weights_cpu_example(tmp_path) -> None:
    result = subprocess.run([sys.executable, str(EXAMPLES / "finetune_hf_weights_cpu.py"),
                             str(tmp_path / "work")], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "exported step 3" in result.stdout and "(1, 16, 256) logits" in result.stdout
    assert "missing" not in result.stderr.lower()  # from_pretrained found every weight


def test_finetune_peft_cpu_example(tmp_path) -> None:
    """The fine-tuning walk-through: instruction data, a LoRA plan, 30 steps under torchrun
    from saved weights, the adapter exported and applied to the unsharded model."""
    import re

    result = subprocess.run([sys.executable, str(EXAMPLES / "finetune_peft_cpu.py"),
                             str(tmp_path / "work")], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    first, last = map(float, re.search(r"loss: ([\d.]+) -> ([\d.]+)", result.stdout).groups())
    assert last < first - 0.1, result.stdout
    # r=8 on tiny Llama's 7 linears per layer (64 wide, kv 32, MLP 176), 4 layers
    assert "lora: 37,376 trained parameters" in result.stdout


def test_serve_at_scale_example() -> None:
    out = run("serve_at_scale.py", "--model", "llama3-8b", "--concurrency", "16", "--seq", "2048")
    assert "fastest decoding" in out and "ms a token" in out and "KV cache" in out
    assert "no serving plan fits" in out and "at most" in out
    assert "Decoding step, along the bottleneck stage" in out


@pytest.mark.dist
def test_train_eval_profile_cpu_example(tmp_path) -> None:
    """Warm-up then cosine, held-out loss, a profile, and the report with the run beside it."""
    import json
    import math

    art = tmp_path / "art"
    result = subprocess.run([sys.executable, str(EXAMPLES / "train_eval_profile_cpu.py"),
                             str(art)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout
    rates = [json.loads(line)["lr"]
             for line in (art / "logs" / "train.jsonl").read_text().splitlines()]
    peak, floor = 3e-3, 3e-4  # 2 warm-up steps, then cosine over the 6 steps left
    assert rates == pytest.approx([peak / 2, peak] + [
        floor + (peak - floor) * (1 + math.cos(math.pi * (s - 2) / 6)) / 2 for s in range(2, 8)])
    assert [ln.split()[3] for ln in out.splitlines() if ln.startswith("eval after")] == \
        ["4:", "8:"]
    assert "traces (open in ui.perfetto.dev): rank0.trace.json, rank1.trace.json" in out
    assert "The run\n  steps       8: loss " in out
    table = out[out.index("Measured against predicted, per stage (profiled steps 5..7)"):]
    rows = [ln.split()[:2] for ln in table.splitlines()[2:16]]  # 7 terms for each stage
    assert [r for r in rows if r[1] in ("step", "memory")] == \
        [["0", "step"], ["0", "memory"], ["1", "step"], ["1", "memory"]]


def test_toy_parallelism_example(tmp_path) -> None:
    """docs/architecture.md's worked example: the toy touches only the files it names, the
    search chooses it, train.py calls it, and training with it equals training without."""
    out = run("toy_parallelism/try_it.py", str(tmp_path))
    assert ("files the toy adds or changes: cost/last_layer_gathered.py, "
            "parallel/last_layer_gathered.py, plan/parallelisms.py\n") in out
    assert "toy chosen: parallelisms {'last_layer_gathered': True}" in out
    assert "last_layer_gathered.apply(model, mesh, plan, True)" in out
    assert "toy off: parallelisms {}" in out and "same losses: True" in out
