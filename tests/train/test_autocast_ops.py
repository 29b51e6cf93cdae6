"""The autocast rule for MoE experts' grouped GEMM: under bf16 autocast it runs in bf16 on
fp32 weights, the weights get fp32 gradients, and the values are the per-group products. Run in
a fresh interpreter: the rule is registered for the whole process."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = r"""
import torch
from autopar.train.autocast_ops import register_grouped_mm_autocast
torch.manual_seed(0)
a = torch.randn(16, 32, requires_grad=True)
w = torch.randn(2, 32, 16, requires_grad=True)
offs = torch.tensor([8, 16], dtype=torch.int32)
with torch.autocast("cpu", dtype=torch.bfloat16):
    before = torch._grouped_mm(a, w, offs=offs).dtype
register_grouped_mm_autocast("cpu")
register_grouped_mm_autocast("cpu")  # once per process
with torch.autocast("cpu", dtype=torch.bfloat16):
    out = torch._grouped_mm(a, w, offs=offs)
out.float().sum().backward()
ref = torch.cat([a[:8] @ w[0], a[8:] @ w[1]])
error = float(((out.float() - ref).abs().max() / ref.abs().max()))
print(before, out.dtype, a.grad.dtype, w.grad.dtype, error < 2e-2)
"""


def test_grouped_mm_runs_in_the_autocast_dtype_with_fp32_weight_gradients() -> None:
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    # without the rule autocast left it in fp32; with it, bf16 out and fp32 gradients
    assert result.stdout.split() == ["torch.float32", "torch.bfloat16", "torch.float32",
                                     "torch.float32", "True"], result.stdout
