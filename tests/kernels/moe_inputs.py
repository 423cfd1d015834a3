"""Inputs shared by the routed-expert kernel tests (`test_moe.py`, `test_w4a16.py`): the tiny
and K3-slice shapes and the whole-pass check against the fp32 reference. Not a test module."""

import torch
from k3kernels.moe import TOLERANCES
from k3kernels.moe import reference as R
from k3kernels.moe.experts import fused_experts

from k3batch.testing import assert_close

# name -> (T, D, I, E, k, first_expert, local experts); E is the model's expert count.
TINY = {
    "T1-D32-I24-E8-k2": (1, 32, 24, 8, 2, 0, 8),
    "T33-D32-I24-E8-k2": (33, 32, 24, 8, 2, 0, 8),
    "T40-D64-I40-E6-k3": (40, 64, 40, 6, 3, 0, 6),
    "T33-D32-I24-E8-k2-ep4of8": (33, 32, 24, 8, 2, 4, 4),
}
K3_SLICE = {
    "T8192-prefill": (8192, 3584, 3072, 112, 2, 0, 112),
    "T64-decode": (64, 3584, 3072, 112, 2, 0, 112),
    "T1-decode": (1, 3584, 3072, 112, 2, 0, 112),
    "T8192-ep2-rank1": (8192, 3584, 3072, 112, 2, 56, 56),
}
# Kimi Linear 48B-A3B (issue 54): D 2,304, expert width 1,024, 256 experts, top-8, SwiGLU; at an
# 8K chunk ~256 rows an expert
KIMI_LINEAR = {
    "kimi-T8192-prefill": (8192, 2304, 1024, 256, 8, 0, 256),
    "kimi-T64-decode": (64, 2304, 1024, 256, 8, 0, 256),
    "kimi-T1-decode": (1, 2304, 1024, 256, 8, 0, 256),
}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def inputs(shape, dtype, device, seed=0):
    """(x, w13, w2, ids, weights): fp32 draws cast to dtype; ids are distinct per token.
    Drawn on `device`: at K3-slice shapes the weights are 3.7 G values, which a CPU generator
    takes ~30 s to draw (the first H200 run timed out on that, not on a kernel)."""
    T, D, I, E, k, first, local = shape
    g = torch.Generator(device=device).manual_seed(seed)

    def draw(fn, *size):
        return fn(*size, generator=g, device=device)

    x = draw(torch.randn, T, D)
    w13 = draw(torch.randn, local, 2 * I, D) / D**0.5
    w2 = draw(torch.randn, local, D, I) / I**0.5
    ids = draw(torch.rand, T, E).topk(k, dim=-1).indices
    w = draw(torch.rand, T, k) + 0.1
    return x.to(dtype), w13.to(dtype), w2.to(dtype), ids, w


def check_experts(shape, dtype, device, use_triton, gemm_impl="torch", mxfp4=False, act="situ"):
    """The whole pass against the fp32 reference; mxfp4: the weights quantized, the pass fed
    them packed (W4A16 with use_triton and gemm_impl "auto" or "triton"), the reference their
    dequantized values; act: "situ" (K3) or "silu" (Kimi Linear's SwiGLU)."""
    x, w13, w2, ids, w = inputs(shape, dtype, device)
    first = shape[5]
    kw = dict(act=act, beta=4.0, linear_beta=25.0, first_expert=first)
    if mxfp4:
        from k3kernels.moe.mxfp4 import MXFP4Weight, quantize_mxfp4

        w13, w2 = (MXFP4Weight.from_checkpoint(*quantize_mxfp4(t)) for t in (w13, w2))
        ref = R.experts_reference(x, w13.dequantize(dtype), w2.dequantize(dtype), ids, w, **kw)
    else:
        ref = R.experts_reference(x, w13, w2, ids, w, **kw)
    out = fused_experts(x, w13, w2, ids, w, use_triton=use_triton, gemm_impl=gemm_impl, **kw)
    assert out.dtype == torch.float32
    rel, mx = TOLERANCES[("experts", dtype)]
    return assert_close("experts", ref, out, rel_rms=rel, max_abs=mx)
