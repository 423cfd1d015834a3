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
`swap_ab` (a launch setting) computes out^T = w x^T instead: the unpacked weights become the
MMA's first operand, which Hopper's wgmma takes from registers, while the second operand (here
the few rows of x) goes through shared memory. In the plain form the unpacked weights are the
second operand and make that round trip: 4 bytes of bf16 written and read per packed byte,
which at decode (few rows, the weights streamed once) can bound the kernel by shared-memory
bandwidth rather than by HBM. Not yet measured; `bench moe --sweep` times both forms.
Reference: `reference.grouped_mm_mxfp4_reference` (dequantize, then the loop). Runs under
TRITON_INTERPRET=1 on CPU.
Shape legend: M sorted rows, K input width, N output width, E experts.
"""

import torch
import triton
import triton.language as tl

from k3kernels.moe.grouped_gemm_triton import (
    _INTERPRETED,
    launch_config,
    program_tile,
    tile_rows_cols,
    tile_table,
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
    """bf16 values of the low and high nibbles of bytes q (uint8) times scale (bf16, one per
    byte), in PTX on packed bf16 pairs (sm_90): a byte pair is spread into the two halves of a
    register (prmt); each nibble's sign and exponent-mantissa bits are shifted into place as a
    bf16 bit pattern v whose value is code * 2^-126 (exact: small codes land on subnormals,
    which bf16 arithmetic keeps), then v * 2^126 * scale. 13 instructions per 4 values, against
    ~12 per value for the integer path of `_e2m1_times_scale`."""
    return tl.inline_asm_elementwise(
        asm="""
        {
        .reg .b32 t, a, b, m_em, m_sign, m_em_hi, two126;
        mov.b32 m_em, 0x01C001C0;
        mov.b32 m_sign, 0x80008000;
        mov.b32 two126, 0x7E807E80;
        prmt.b32 t, $4, 0, 0x4140;
        shl.b32 a, t, 6;
        shl.b32 b, t, 12;
        and.b32 b, b, m_sign;
        lop3.b32 a, a, m_em, b, 0xEA;
        mul.rn.bf16x2 a, a, two126;
        mul.rn.bf16x2 $0, a, $5;
        shl.b32 a, t, 2;
        shl.b32 b, t, 8;
        and.b32 b, b, m_sign;
        lop3.b32 a, a, m_em, b, 0xEA;
        mul.rn.bf16x2 a, a, two126;
        mul.rn.bf16x2 $2, a, $5;
        prmt.b32 t, $4, 0, 0x4342;
        shl.b32 a, t, 6;
        shl.b32 b, t, 12;
        and.b32 b, b, m_sign;
        lop3.b32 a, a, m_em, b, 0xEA;
        mul.rn.bf16x2 a, a, two126;
        mul.rn.bf16x2 $1, a, $6;
        shl.b32 a, t, 2;
        shl.b32 b, t, 8;
        and.b32 b, b, m_sign;
        lop3.b32 a, a, m_em, b, 0xEA;
        mul.rn.bf16x2 a, a, two126;
        mul.rn.bf16x2 $3, a, $6;
        }
        """,
        constraints="=r,=r,=r,=r,r,r,r",
        args=[q, scale],
        dtype=(tl.bfloat16, tl.bfloat16),
        is_pure=True,
        pack=4,
    )


@triton.jit
def _tile(col_ptrs, idx, col_ok, idx_ok, TRANS: tl.constexpr):
    """Pointers and mask of a weight tile: [len(idx), BLOCK_N] (idx along the rows), or its
    transpose [BLOCK_N, len(idx)] with TRANS."""
    if TRANS:
        return col_ptrs[:, None] + idx[None, :], col_ok[:, None] & idx_ok[None, :]
    return col_ptrs[None, :] + idx[:, None], idx_ok[:, None] & col_ok[None, :]


@triton.jit
def w4a16_grouped_kernel(x_ptr, q_ptr, s_ptr, out_ptr, offs_ptr, table_ptr, P,
                         N, K, stride_x, stride_qe, stride_qn, stride_se, stride_sn, stride_out, E,
                         GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, UPCAST: tl.constexpr, PTX: tl.constexpr,
                         SWAP_AB: tl.constexpr):  # fmt: skip
    expert, first, n_block = program_tile(table_ptr, P, N, E, BLOCK_N)
    if expert < E:
        rows, cols, row_ok, col_ok = tile_rows_cols(first, offs_ptr, expert, n_block, N,
                                                    BLOCK_M, BLOCK_N)  # fmt: skip
        jj = tl.arange(0, BLOCK_K // 2)  # byte within the tile: inputs 2 jj and 2 jj + 1
        kk = tl.arange(0, BLOCK_K)
        x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_x
        q_cols = q_ptr + expert.to(tl.int64) * stride_qe + cols.to(tl.int64) * stride_qn
        s_cols = s_ptr + expert.to(tl.int64) * stride_se + cols.to(tl.int64) * stride_sn
        if SWAP_AB:  # weight tiles [BLOCK_N, BLOCK_K / 2], the output transposed
            acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        else:  # weight tiles [BLOCK_K / 2, BLOCK_N]
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            # Indices written so that the compiler sees contiguous runs (vector loads): bytes
            # k0/2 + jj, scale groups k0/GROUP + jj/(GROUP/2), inputs k0 + kk.
            q_ptrs, wmask = _tile(q_cols, k0 // 2 + jj, col_ok, k0 // 2 + jj < K // 2, SWAP_AB)
            q = tl.load(q_ptrs, mask=wmask, other=0)
            if PTX:  # bf16 activations on the GPU: one scale row per group, spread over its bytes
                gg = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
                s_ptrs, g_ok = _tile(s_cols, gg, col_ok, gg < tl.cdiv(K, GROUP), SWAP_AB)
                s = tl.load(s_ptrs, mask=g_ok, other=127).to(tl.int16)
                s = tl.where(s > 0, s << 7, 64).to(tl.bfloat16, bitcast=True)  # 2^(s - 127)
                if SWAP_AB:
                    s = tl.broadcast_to(s[:, :, None], [BLOCK_N, BLOCK_K // GROUP, GROUP // 2])
                    s = tl.reshape(s, [BLOCK_N, BLOCK_K // 2])
                else:
                    s = tl.broadcast_to(s[:, None, :], [BLOCK_K // GROUP, GROUP // 2, BLOCK_N])
                    s = tl.reshape(s, [BLOCK_K // 2, BLOCK_N])
                w_even, w_odd = _e2m1_pairs_bf16(q, s)
            else:
                q = q.to(tl.int32)
                s_ptrs, _ = _tile(s_cols, k0 // GROUP + jj // (GROUP // 2), col_ok, jj >= 0,
                                  SWAP_AB)  # fmt: skip
                s = tl.load(s_ptrs, mask=wmask, other=127).to(tl.int32)
                scale_bits = tl.where(s > 0, s << 23, 1 << 22)  # 2^(s - 127); s = 0: subnormal
                w_even = _e2m1_times_scale(q & 15, scale_bits)
                w_odd = _e2m1_times_scale(q >> 4, scale_bits)
            xmask = row_ok[:, None] & (k0 + kk < K)[None, :]
            x = tl.load(x_rows + (k0 + kk)[None, :], mask=xmask, other=0.0)  # [BLOCK_M, BLOCK_K]
            x_even, x_odd = tl.split(tl.reshape(x, [BLOCK_M, BLOCK_K // 2, 2]))
            if UPCAST:  # the CPU interpreter multiplies bf16 bit patterns as integers
                x_even, x_odd = x_even.to(tl.float32), x_odd.to(tl.float32)
            else:
                w_even, w_odd = w_even.to(x_even.dtype), w_odd.to(x_odd.dtype)
            if SWAP_AB:
                acc = tl.dot(w_even, tl.trans(x_even), acc)
                acc = tl.dot(w_odd, tl.trans(x_odd), acc)
            else:
                acc = tl.dot(x_even, w_even, acc)
                acc = tl.dot(x_odd, w_odd, acc)
        if SWAP_AB:
            o_ptrs = out_ptr + rows.to(tl.int64)[None, :] * stride_out + cols[:, None]
            o_mask = col_ok[:, None] & row_ok[None, :]
        else:
            o_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_out + cols[None, :]
            o_mask = row_ok[:, None] & col_ok[None, :]
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=o_mask)


def grouped_mm_mxfp4(x_MK: torch.Tensor, w: MXFP4Weight, offs_E: torch.Tensor,
                     **config) -> torch.Tensor:  # fmt: skip
    """out[r] = x[r] @ dequantize(w[e]).T for the rows r of group e; x [M, K] (unit last
    stride), w: packed [E, N, K/2] and scale [E, N, ceil(K/32)] uint8 with unit last strides,
    offs [E] int32 cumulative group ends. Rows after offs[-1] are left unwritten.
    config: block_m, block_n, block_k, num_warps, num_stages, swap_ab (default `launch_config`;
    swap_ab: see the module doc)."""
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
    table = tile_table(offs_E, M, cfg["block_m"])
    P = table.shape[1]
    w4a16_grouped_kernel[(P * triton.cdiv(N, cfg["block_n"]),)](
        x_MK, w.packed, w.scale, out, offs_E, table, P, N, K, x_MK.stride(0),
        w.packed.stride(0), w.packed.stride(1), w.scale.stride(0), w.scale.stride(1),
        out.stride(0), E, GROUP=GROUP_SIZE, BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"],
        BLOCK_K=cfg["block_k"], UPCAST=_INTERPRETED and x_MK.dtype != torch.float32,
        PTX=not _INTERPRETED and x_MK.dtype == torch.bfloat16, SWAP_AB=cfg.get("swap_ab", False),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    return out
