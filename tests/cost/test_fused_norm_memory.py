"""A model whose RMSNorms run as one fused kernel (torchtitan's norm_type = "fused_rmsnorm")
keeps, per norm, its bf16 input and an fp32 rstd per row, not the eager chain's fp32 upcast
and normalized copies."""

from __future__ import annotations

import copy

import pytest

import autopar
from autopar.cost.activations import block_activation_bytes


@pytest.fixture(scope="module")
def llama():
    return autopar.capture("tiny-llama", seq=256)


def test_fused_rmsnorm_saves_input_and_rstd_only(llama) -> None:
    fused = copy.copy(llama)
    fused.norm_kernel = "fused_rmsnorm"
    block = llama.blocks[1]
    eager = block_activation_bytes(llama, block).stored_bytes
    kept = block_activation_bytes(fused, block).stored_bytes
    norm = [llama.op(n) for n in block.nodes if "RMSNorm" in llama.op(n).module_type
            and llama.op(n).module_path == llama.op(block.nodes[0]).module_path]
    x = norm[0].input_meta[0]  # the residual the norm reads
    # eager, per norm: the upcast copy of x, the normalized copy before the weight multiply
    # (the two ``to`` ops) and the rstd; fused: x itself and the fp32 rstd per row (as wide as
    # the eager rstd in an fp32 graph). The output stays, saved by the projections that read it
    copies = sum(op.output_meta[0].nbytes for op in norm if op.target == "aten.to.dtype")
    rstd = next(op for op in norm if op.target == "aten.rsqrt.default").output_meta[0].nbytes
    per_norm = copies + rstd - (x.nbytes + x.numel // x.shape[-1] * 4)
    assert per_norm > 0
    assert eager - kept == pytest.approx(2 * per_norm)  # input_layernorm, post_attention


def test_unknown_norm_kernel_is_refused(llama) -> None:
    bad = copy.copy(llama)
    bad.norm_kernel = "apex"
    with pytest.raises(ValueError, match="norm_kernel"):
        block_activation_bytes(bad, llama.blocks[1])
