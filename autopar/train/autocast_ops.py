"""Autocast for the grouped matmul of mixture-of-experts layers.

torch's autocast runs linear and matmul in the compute dtype, but has no rule for
``aten::_grouped_mm``, the grouped GEMM that Hugging Face's MoE experts call (transformers 5's
default experts implementation). autopar keeps fp32 master weights and trains under autocast,
so the experts' GEMMs ran in fp32: on an H200, a 4-layer Qwen3-30B-A3B-shaped model trained at
1.19 s a step with its expert GEMMs as fp32 SIMT kernels, against 0.43 s for the same forward and
backward in bf16 (measured with the device tool, docs/moe.md). The rule registered here casts
both operands to the autocast dtype, as autocast does for ``mm``; autograd records the casts, so
the fp32 weights get their gradients.
"""

from __future__ import annotations

import torch

_REGISTERED: dict[str, torch.library.Library] = {}
_KEYS = {"cuda": "AutocastCUDA", "cpu": "AutocastCPU"}


def _grouped_mm_kernel(device_type: str):
    def grouped_mm(mat1: torch.Tensor, mat2: torch.Tensor, offs: torch.Tensor | None = None,
                   bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None
                   ) -> torch.Tensor:
        dtype = torch.get_autocast_dtype(device_type)
        cast = [t.to(dtype) if t is not None and t.is_floating_point() else t
                for t in (mat1, mat2, bias)]
        with torch.autocast(device_type, enabled=False):
            return torch._grouped_mm(cast[0], cast[1], offs=offs, bias=cast[2],
                                     out_dtype=out_dtype)
    return grouped_mm


def register_grouped_mm_autocast(device_type: str = "cuda") -> None:
    """Give ``aten::_grouped_mm`` an autocast rule on ``device_type`` (once per process)."""
    if device_type in _REGISTERED or device_type not in _KEYS:
        return
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("_grouped_mm", _grouped_mm_kernel(device_type), _KEYS[device_type])
    _REGISTERED[device_type] = lib


__all__ = ["register_grouped_mm_autocast"]
