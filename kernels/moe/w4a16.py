"""Grouped GEMM over experts with MXFP4 weights unpacked in registers (W4A16): activations bf16
(or fp32), weights 4-bit E2M1 values with one E8M0 scale per 32 inputs (`mxfp4.py` has the
format), fp32 accumulation. Hopper has no FP4 tensor cores, so each program loads a tile of
packed bytes and their scales, turns them into the activations' dtype (exact: an E2M1 value
times a power of two is a bf16 number) and multiplies on the bf16 tensor cores. Same contract,
tile table and launch settings as the bf16 Triton grouped GEMM (`grouped_gemm_triton`): rows
[offs[e-1], offs[e]) of x times expert e's weight, rows after offs[-1] left unwritten.

Byte j of a packed row holds input 2j (low nibble) and 2j+1 (high nibble), so a tile of
BLOCK_K inputs is BLOCK_K / 2 bytes: the program multiplies the even inputs of x by the low
nibbles and the odd inputs by the high ones, two dots of BLOCK_K / 2, instead of interleaving.
E2M1 code c: sign bit 3, exponent bits 2..1 (bias 1), mantissa bit 0; built as fp32 bits.
On the GPU the unpacking is bound by instruction issue, not by HBM: at the decode tiles the
loop spends ~3.6 instructions per weight (SASS: 2.25 to unpack and scale, ~0.25 to pack the
scales into bf16 pairs, the rest loads, MMAs and addresses). Hence: masks only when a tile
overhangs K or N (`EVEN`), one multiply per value pair when the scales are small
(`SMALL_SCALES`), and the placement by multiply of `_e2m1_pairs_bf16`. One H200, k3-slice, 7
layers (`k3batch bench moe --expert-dtype mxfp4`): 64 tokens 6.4 -> 4.5 ms timed eagerly, 3.6
ms as CUDA-graph replays once the tile table went (2.53 TB/s on the packed bytes, 59% of the
copy bandwidth); 8,192 tokens 38.7 -> 28.5 ms (72% of the bf16 grouped GEMM's throughput).
Computing out^T = w x^T instead (the unpacked weights as the MMA's register operand) measured
slower at both shapes and was dropped.
Reference: `reference.grouped_mm_mxfp4_reference` (dequantize, then the loop). Runs under
TRITON_INTERPRET=1 on CPU.
Shape legend: M sorted rows, K input width, N output width, E experts.
"""

import torch
import triton
import triton.language as tl

from k3kernels.moe.grouped_gemm_triton import (
    _INTERPRETED,
    block_e,
    launch_config,
    num_tile_slots,
    program_tile,
    tile_rows_cols,
)
from k3kernels.moe.mxfp4 import GROUP_SIZE, MXFP4Weight


@triton.jit
def _e2m1_times_scale(code, scale_bits):
    """fp32 value of 4-bit E2M1 codes (int32) times 2^(s - 127) given as fp32 bits (int32)."""
    e = (code >> 1) & 3
    m = code & 1
    normal = ((e + 126) << 23) | (m << 22)  # (1 + m/2) * 2^(e - 1)
    sub = m * (126 << 23)  # e = 0: m * 0.5
    bits = tl.where(e > 0, normal, sub) | ((code & 8) << 28)
    return bits.to(tl.float32, bitcast=True) * scale_bits.to(tl.float32, bitcast=True)


@triton.jit
def _e2m1_pairs_bf16(q, scale):
    """bf16 values of the low and high nibbles of bytes q (uint8) times 2^-126 scale (scale:
    bf16, one per byte), in PTX on packed bf16 pairs (sm_90). A byte pair is spread into the
    two halves of a register t (prmt). Per nibble: masked out of t, placed by one multiply
    (low nibble: t * (2^6 + 2^12) puts its exponent-mantissa bits at 6..8 and its sign at 15 of
    each half; high nibble: * (2^2 + 2^8); the two shifted copies do not overlap, so no carry),
    masked again: a bf16 bit pattern whose value is code * 2^-126 (exact: small codes land on
    subnormals, which bf16 arithmetic keeps); then one multiply by scale. With scale = 2^126 *
    2^(s - 127) = 2^(s - 1), a normal bf16 number while s <= 128 (`MXFP4Weight.small_scales`),
    that is the weight: 9 instructions per 4 values, against ~12 per value for the integer path
    of `_e2m1_times_scale`."""
    return tl.inline_asm_elementwise(
        asm="""
        {
        .reg .b32 t, a, b;
        prmt.b32 t, $4, 0, 0x4140;
        and.b32 a, t, 0x000F000F;
        mul.lo.u32 a, a, 0x1040;
        and.b32 a, a, 0x81C081C0;
        mul.rn.bf16x2 $0, a, $5;
        and.b32 b, t, 0x00F000F0;
        mul.lo.u32 b, b, 0x0104;
        and.b32 b, b, 0x81C081C0;
        mul.rn.bf16x2 $2, b, $5;
        prmt.b32 t, $4, 0, 0x4342;
        and.b32 a, t, 0x000F000F;
        mul.lo.u32 a, a, 0x1040;
        and.b32 a, a, 0x81C081C0;
        mul.rn.bf16x2 $1, a, $6;
        and.b32 b, t, 0x00F000F0;
        mul.lo.u32 b, b, 0x0104;
        and.b32 b, b, 0x81C081C0;
        mul.rn.bf16x2 $3, b, $6;
        }
        """,
        constraints="=r,=r,=r,=r,r,r,r",
        args=[q, scale],
        dtype=(tl.bfloat16, tl.bfloat16),
        is_pure=True,
        pack=4,
    )


@triton.jit
def _per_byte(s, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Per-group values [BLOCK_K / GROUP, BLOCK_N] spread over the bytes of their groups:
    [BLOCK_K / 2, BLOCK_N]."""
    s = tl.broadcast_to(s[:, None, :], [BLOCK_K // GROUP, GROUP // 2, BLOCK_N])
    return tl.reshape(s, [BLOCK_K // 2, BLOCK_N])


@triton.jit
def w4a16_grouped_kernel(x_ptr, q_ptr, s_ptr, out_ptr, offs_ptr, N, K, stride_x, stride_qe,
                         stride_qn, stride_se, stride_sn, stride_out, E, GROUP: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         BLOCK_E: tl.constexpr, UPCAST: tl.constexpr, PTX: tl.constexpr,
                         EVEN: tl.constexpr, SMALL_SCALES: tl.constexpr):  # fmt: skip
    expert, first, n_block = program_tile(offs_ptr, E, N, BLOCK_M, BLOCK_N, BLOCK_E)
    if expert < E:
        rows, cols, row_ok, col_ok = tile_rows_cols(first, offs_ptr, expert, n_block, N,
                                                    BLOCK_M, BLOCK_N)  # fmt: skip
        jj = tl.arange(0, BLOCK_K // 2)  # byte within the tile: inputs 2 jj and 2 jj + 1
        kk = tl.arange(0, BLOCK_K)
        x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_x
        q_cols = q_ptr + expert.to(tl.int64) * stride_qe + cols.to(tl.int64) * stride_qn
        s_cols = s_ptr + expert.to(tl.int64) * stride_se + cols.to(tl.int64) * stride_sn
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            # Weight tiles [BLOCK_K / 2, BLOCK_N], indices written so that the compiler sees
            # contiguous runs (vector loads): bytes k0/2 + jj, scale groups k0/GROUP + jj/(GROUP/2),
            # inputs k0 + kk.
            q_ptrs = q_cols[None, :] + (k0 // 2 + jj)[:, None]
            wmask = (k0 // 2 + jj < K // 2)[:, None] & col_ok[None, :]
            if EVEN:
                q = tl.load(q_ptrs)
            else:
                q = tl.load(q_ptrs, mask=wmask, other=0)
            if PTX:  # bf16 activations on the GPU: one scale row per group, spread over its bytes
                gg = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
                s_ptrs = s_cols[None, :] + gg[:, None]
                g_ok = (gg < tl.cdiv(K, GROUP))[:, None] & col_ok[None, :]
                if EVEN:
                    s = tl.load(s_ptrs).to(tl.int16)
                else:
                    s = tl.load(s_ptrs, mask=g_ok, other=127).to(tl.int16)
                if SMALL_SCALES:  # 2^(s - 1): the unpacking's 2^126 folded into the scale
                    s = ((s + 126) << 7).to(tl.bfloat16, bitcast=True)
                else:  # 2^126 there, then 2^(s - 127) (s = 0: a subnormal) as a second product
                    s_exact = tl.where(s > 0, s << 7, 64).to(tl.bfloat16, bitcast=True)
                    s = tl.full(s.shape, 0x7E80, tl.int16).to(tl.bfloat16, bitcast=True)
                w_even, w_odd = _e2m1_pairs_bf16(q, _per_byte(s, GROUP, BLOCK_N, BLOCK_K))
                if not SMALL_SCALES:
                    s_exact = _per_byte(s_exact, GROUP, BLOCK_N, BLOCK_K)
                    w_even, w_odd = w_even * s_exact, w_odd * s_exact
            else:
                q = q.to(tl.int32)
                s_ptrs = s_cols[None, :] + (k0 // GROUP + jj // (GROUP // 2))[:, None]
                s = tl.load(s_ptrs, mask=wmask, other=127).to(tl.int32)
                scale_bits = tl.where(s > 0, s << 23, 1 << 22)  # 2^(s - 127); s = 0: subnormal
                w_even = _e2m1_times_scale(q & 15, scale_bits)
                w_odd = _e2m1_times_scale(q >> 4, scale_bits)
            if EVEN:
                xmask = row_ok[:, None]
            else:
                xmask = row_ok[:, None] & (k0 + kk < K)[None, :]
            x = tl.load(x_rows + (k0 + kk)[None, :], mask=xmask, other=0.0)  # [BLOCK_M, BLOCK_K]
            x_even, x_odd = tl.split(tl.reshape(x, [BLOCK_M, BLOCK_K // 2, 2]))
            if UPCAST:  # the CPU interpreter multiplies bf16 bit patterns as integers
                x_even, x_odd = x_even.to(tl.float32), x_odd.to(tl.float32)
            else:
                w_even, w_odd = w_even.to(x_even.dtype), w_odd.to(x_odd.dtype)
            acc = tl.dot(x_even, w_even, acc)
            acc = tl.dot(x_odd, w_odd, acc)
        o_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_out + cols[None, :]
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def grouped_mm_mxfp4(x_MK: torch.Tensor, w: MXFP4Weight, offs_E: torch.Tensor,
                     **config) -> torch.Tensor:  # fmt: skip
    """out[r] = x[r] @ dequantize(w[e]).T for the rows r of group e; x [M, K] (unit last
    stride), w: packed [E, N, K/2] and scale [E, N, ceil(K/32)] uint8 with unit last strides,
    offs [E] int32 cumulative group ends. Rows after offs[-1] are left unwritten.
    config: block_m, block_n, block_k, num_warps, num_stages (default `launch_config`)."""
    E, N, K = w.shape
    if x_MK.shape[1] != K or x_MK.stride(-1) != 1:
        raise ValueError(f"x {list(x_MK.shape)} does not match MXFP4 weights of {K} inputs "
                         f"(or its last stride is not 1)")  # fmt: skip
    if w.packed.stride(-1) != 1 or w.scale.stride(-1) != 1:
        raise ValueError("MXFP4 packed values and scales need unit last strides")
    M = x_MK.shape[0]
    cfg = launch_config(M, E, "mxfp4") | config
    if cfg["block_k"] % GROUP_SIZE:
        raise ValueError(f"block_k = {cfg['block_k']} must be a multiple of {GROUP_SIZE}")
    out = torch.empty(M, N, dtype=x_MK.dtype, device=x_MK.device)
    if M == 0:
        return out
    grid = (num_tile_slots(M, E, cfg["block_m"]) * triton.cdiv(N, cfg["block_n"]),)
    w4a16_grouped_kernel[grid](
        x_MK, w.packed, w.scale, out, offs_E, N, K, x_MK.stride(0),
        w.packed.stride(0), w.packed.stride(1), w.scale.stride(0), w.scale.stride(1),
        out.stride(0), E, GROUP=GROUP_SIZE, BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"],
        BLOCK_K=cfg["block_k"], BLOCK_E=block_e(E),
        UPCAST=_INTERPRETED and x_MK.dtype != torch.float32,
        PTX=not _INTERPRETED and x_MK.dtype == torch.bfloat16,
        EVEN=K % cfg["block_k"] == 0 and N % cfg["block_n"] == 0, SMALL_SCALES=w.small_scales,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    return out
