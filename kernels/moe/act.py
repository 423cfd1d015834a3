"""Fused gated activation: one pass over the gate and up GEMM outputs.

`moe_act`: h [M, 2 I] holds gate columns [0, I) and up columns [I, 2 I): the experts' (w13 =
[w1; w3]) and, through `model.layers.FusedRows`, the dense FFN's and the shared experts'.
One Triton program computes a BLOCK_I slice of BLOCK_M rows in fp32 and stores it in the output
dtype: SiTU (K3) beta tanh(g / beta) sigmoid(g) * linear_beta tanh(u / linear_beta), or SwiGLU
silu(g) * u, with one reciprocal an element (`gated`, also the epilogue of the gate-up grouped
GEMM where its launch fuses the activation). On one H200, SiTU at 16,384 x 3,072 bf16
(k3-slice prefill): 74 us, 4.08 TB/s, 96% of the copy bandwidth, against 101 us with three
approximate divisions (`tl.fdiv`) and Triton's exp (scratch A/B in one process,
`benchmarks/kernels_h200.txt`, tenth session); SwiGLU 74 us either way.
Oracle: `reference.gated_act_reference`. Runs under TRITON_INTERPRET=1 on CPU.
Shape legend: M rows, I expert width.
"""

import torch
import triton
import triton.language as tl

from k3kernels import INTERPRETED
from k3kernels.moe.interleave import STEP, interleaved_column
from k3kernels.pdl import launch_options, wait_then_signal

# Launch settings, the best of 24 on one H200 (SiTU, bf16, the three divisions of before;
# `benchmarks/kernels_h200.txt`): two rows of 1,024 columns per program from 4,096 rows on
# (16,384 x 3,072: 0.103 ms against 0.111 with one row), one row below (512 x 3,072: fewer,
# fuller waves).
BLOCK_M, BLOCK_I, NUM_WARPS, MIN_ROWS_FOR_TWO = 2, 1024, 4, 4096


@triton.jit
def gated(g, u, beta, linear_beta, IS_SITU: tl.constexpr, PTX: tl.constexpr):
    """act(g, u) of fp32 tiles, SiTU or SwiGLU, with one reciprocal.
    tanh |z| = (1 - e) / (1 + e) with e = exp(-2 |z|) <= 1, sigmoid(g) = 1 / (1 + exp(-g)): SiTU
    is beta linear_beta (1 - e_g)(1 - e_u) / ((1 + e_g)(1 + e_u)(1 + exp(-g))), signed, and a
    denominator that overflows (g < -88) gives 0, the limit. exp is exp2 of a product by
    log2(e). PTX (on the GPU): exp2 and the reciprocal as the single MUFU instructions
    `ex2.approx.ftz` and `rcp.approx.ftz` (within 2 ulp; Triton's exp2 and division add range
    handling around each); the interpreter has no inline PTX."""
    s_g = _exp2(g * -1.4426950408889634, PTX)  # exp(-g)
    if IS_SITU:
        e_g = _exp2(tl.abs(g) * (-2.8853900817779268 / beta), PTX)  # exp(-2 |g| / beta)
        e_u = _exp2(tl.abs(u) * (-2.8853900817779268 / linear_beta), PTX)
        num = (1.0 - e_g) * (1.0 - e_u) * (beta * linear_beta)
        y = num * _rcp((1.0 + e_g) * (1.0 + e_u) * (1.0 + s_g), PTX)
        return tl.where((g < 0) != (u < 0), -y, y)
    return g * u * _rcp(1.0 + s_g, PTX)


@triton.jit
def _exp2(x, PTX: tl.constexpr):
    if PTX:
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x],
                                         dtype=tl.float32, is_pure=True, pack=1)  # fmt: skip
    return tl.exp2(x)


@triton.jit
def _rcp(x, PTX: tl.constexpr):
    if PTX:
        return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [x],
                                         dtype=tl.float32, is_pure=True, pack=1)  # fmt: skip
    return 1.0 / x


@triton.jit
def gated_act_kernel(g_ptr, u_ptr, out_ptr, stride_g, stride_u, stride_part, stride_out, M, I,
                     beta, linear_beta, IS_SITU: tl.constexpr, INTERLEAVE: tl.constexpr,
                     PARTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr,
                     PTX: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    wait_then_signal(PDL)
    row = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)[:, None]
    col = (tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I))[None, :]
    mask = (row < M) & (col < I)
    g = tl.load(g_ptr + row * stride_g + col, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + col, mask=mask, other=0.0).to(tl.float32)
    for p in tl.static_range(1, PARTS):  # partial products of a split K, summed in order
        g += tl.load(g_ptr + p * stride_part + row * stride_g + col, mask=mask, other=0.0)
        u += tl.load(u_ptr + p * stride_part + row * stride_u + col, mask=mask, other=0.0)
    y = gated(g, u, beta, linear_beta, IS_SITU, PTX)
    dst = interleaved_column(col) if INTERLEAVE else col
    tl.store(out_ptr + row * stride_out + dst, y.to(out_ptr.dtype.element_ty), mask=mask)


def moe_act(h_MF: torch.Tensor, act: str, beta: float = 4.0, linear_beta: float = 25.0,
            interleave: bool = False,
            out_dtype: torch.dtype | None = None) -> torch.Tensor:  # fmt: skip
    """act(gate, up) of h [M, 2 I], or of the sum of K's partial products [parts, M, 2 I]
    (`w4a16_decode`), unit column stride -> [M, I] in out_dtype (default h's); interleave: its
    columns in the order of `k3kernels.moe.interleave` (I a multiple of 256)."""
    F = h_MF.shape[-1]
    if h_MF.dim() not in (2, 3) or F % 2 or h_MF.stride(-1) != 1 or (interleave and F // 2 % STEP):
        raise ValueError(f"moe_act needs [M, 2 I] or [parts, M, 2 I] rows with unit column "
                         f"stride (I a multiple of {STEP} to interleave), got "
                         f"{tuple(h_MF.shape)}")  # fmt: skip
    return _launch(h_MF[..., : F // 2], h_MF[..., F // 2 :], act, beta, linear_beta,
                   interleave=interleave, out_dtype=out_dtype)  # fmt: skip


def _launch(g_MI, u_MI, act, beta, linear_beta, block_m=None, interleave=False, out_dtype=None):
    """g and u [M, I], or [parts, M, I] summed over parts."""
    if act not in ("situ", "silu"):
        raise ValueError(f"unknown gated activation {act!r}; known: situ, silu")
    parts, stride_part = (g_MI.shape[0], g_MI.stride(0)) if g_MI.dim() == 3 else (1, 0)
    M, I = g_MI.shape[-2:]
    if block_m is None:
        block_m = BLOCK_M if M >= MIN_ROWS_FOR_TWO else 1
    out = torch.empty(M, I, dtype=out_dtype or g_MI.dtype, device=g_MI.device)
    if M == 0:
        return out
    block_i = min(BLOCK_I, triton.next_power_of_2(I))
    grid = (triton.cdiv(M, block_m), triton.cdiv(I, block_i))
    gated_act_kernel[grid](g_MI, u_MI, out, g_MI.stride(-2), u_MI.stride(-2), stride_part,
                           out.stride(0), M, I, float(beta), float(linear_beta),
                           IS_SITU=act == "situ", INTERLEAVE=interleave, PARTS=parts,
                           BLOCK_M=block_m, BLOCK_I=block_i, PTX=not INTERPRETED,
                           num_warps=NUM_WARPS,
                           **launch_options(out.device))  # fmt: skip
    return out
