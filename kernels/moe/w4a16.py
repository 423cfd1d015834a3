"""Grouped GEMM over experts with MXFP4 weights unpacked in registers (W4A16): activations bf16
(or fp32), weights 4-bit E2M1 values with one E8M0 scale per 32 inputs (`mxfp4.py` has the
format), fp32 accumulation. Hopper has no FP4 tensor cores, so each program loads a tile of
packed bytes and their scales, turns them into the activations' dtype (exact: an E2M1 value
times a power of two is a bf16 number) and multiplies on the bf16 tensor cores. Same contract,
program order and tuned table as the bf16 Triton grouped GEMM (`grouped_gemm_triton`), but
with the rows as the MMA's M side in tiles of block_m rows: rows [offs[e-1], offs[e]) of x
times expert e's weight, rows after offs[-1] left unwritten. With block_t, an expert's last
tile, when it has at most block_t rows, is computed as a tile of block_t rows (its own
program, which unpacks the weights again).

At prefill this kernel is bound by its MMAs, the unpacking hidden beside them: in the sm_90
SASS of the tuned 128 x 128 x 128 tile (4 warps) a 128-input step issues 514 instructions per
warp against 1,024 cycles of MMA work, and on one H200 (7 k3-slice layers x 8,192 tokens) it
took 26.1 ms where the bf16 kernel, at 160 computed rows per ~146-row expert against this
one's 2 x 128, took 16.13 ms: 16.13 x 256 / 160 = 25.8 ms. Hence block_t: with 128 + 32 rows
per such expert (the 32-row tile on mma.sync) the same GEMMs took 21.2 ms, 82% of the bf16
kernel's throughput on the same values (17.4 ms); 128 + 64 (wgmma) took 22.9.

Byte j of a packed row holds inputs 2j and 2j+1, so a tile of BLOCK_K inputs is BLOCK_K / 2
bytes: the program multiplies the even inputs of x by one half of the codes and the odd inputs
by the other, two dots of BLOCK_K / 2, instead of interleaving. The bits of each 4-byte word
are in the word layout (`mxfp4.to_word_layout`, done at load), chosen for the unpacking.
On the GPU the unpacking is bound by instruction issue, not by HBM. At the decode tiles the
loop's SASS had ~3.4 instructions per weight with the checkpoint's nibbles (2.25 to unpack and
scale: per 4 values a byte permute, then per nibble pair a mask, a multiply that placed the
bits, a mask and the scale's multiply; ~0.4 in byte permutes that split x into even and odd
inputs and built the scales' bf16 pairs; the rest loads, MMAs and addresses). With the word
layout a word of 8 codes takes 8 integer instructions (`_e2m1_words_bf16`) and the scales come
as bf16 pairs from one integer multiply-add per group: 879 -> 688 instructions per loop
iteration at 16 x 128 x 256 tiles (2.7 per weight). Also: masks only when a tile overhangs K or
N (`EVEN`), one multiply per value pair when the scales are small (`SMALL_SCALES`). Loading x's
even and odd inputs apart (a layout with each tile's halves in the two nibble sets) compiled
to more instructions (register moves into the MMA operands), and computing out^T = w x^T (the
unpacked weights as the MMA's register operand) measured slower, so neither was kept (at
prefill tiles that form also gave wrong results on the GPU: Triton carried the register
operand's layout back through the unpacking's 4-byte packed inline asm, so a thread's 4 bytes
were no longer one word; three 64-row accumulators sharing one unpacked tile were right but
slower, 31.8 against 26.2 ms for 7 k3-slice layers at 8,192 tokens); nor was
split-K at one token (K in parts, partial sums added by the activation and combine kernels:
0.168 ms against 0.167 for 7 layers).
Nor were activations stored pre-split into each tile's even and odd inputs (no byte permutes:
148 registers, but register moves into the MMA operands) or each K step run as 2-4 sub-steps
(94-124 registers): 12-28% slower at 1, 16 and 64 tokens. Nor a persistent grid, 8 warps, TMA
loads of the packed bytes, each weight tile contiguous in memory, or one kernel per layer for a
few tokens (gate-up, activation and down in one program per slot and inner slice): equal or
slower at 1-64 tokens (`benchmarks/kernels_h200.txt`, 2026-12-03, fifth session). With the
unpacking replaced by moves (wrong values) the same loop reads at 78-83% of the copy bandwidth
at 16-64 tokens against 68-73%, but gains only 12% at one token, where the GEMMs read at 30%
of copy while a plain Triton read of the same bytes reaches 77% and the bf16 kernel 80%: at one
token its 96 gate-up programs run one per SM, each K step taking 1,870 cycles whether the tile
is in HBM or L2, while an SM running two programs completes a step every ~1,290 cycles (70% of
copy at 1.79 GHz, this loop's ceiling at 16-256 tokens). Nor did two accumulators, tiles from a
table, weights joined to x's input order, K in 2-14 parts, a one-row GEMV without MMAs (34% of
copy at one token, behind this kernel from four tokens) or stream-K (one wave sharing the K
steps evenly; 24% at one token, 62% at 64) reach 75% (`benchmarks/kernels_h200.txt`,
2026-12-03, sixth and seventh sessions).
One H200, k3-slice, 7 layers (`k3batch bench moe --expert-dtype mxfp4`), before the word
layout: 64 tokens 3.40 ms as CUDA-graph replays (2.68 TB/s on the packed bytes, 63% of the
copy bandwidth); 8,192 tokens 28.5 ms (72% of the bf16 grouped GEMM's throughput).
At decode sizes on sm_90 the pass uses the Gluon kernel `w4a16_decode` instead (the choice:
`experts.pick_gemm`; the pass 1-256 tokens faster there: 27-73% of copy against 23-68%).
Reference: `reference.grouped_mm_mxfp4_reference` (dequantize, then the loop). Runs under
TRITON_INTERPRET=1 on CPU.
Shape legend: M sorted rows, K input width, N output width, E experts.
"""

import torch
import triton
import triton.language as tl

from k3kernels import INTERPRETED
from k3kernels.moe.act import gated
from k3kernels.moe.grouped_gemm_triton import (
    ACTS,
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
def _e2m1_words_bf16(q, scale):
    """bf16 values of the even and odd inputs of packed bytes q (uint8, the word layout of
    `mxfp4.WORD_BITS`, 4 consecutive bytes = one word) times 2^-126 scale (scale: int32, a
    bf16 pair per byte, both halves the group's), in PTX on packed bf16 pairs (sm_90). Codes 0
    and 2 of a word are already where a bf16 pair wants them (m, e0, e1 at bits 6..8 and s at 15
    of each half: the pattern of code * 2^-126, exact: small codes land on subnormals, which
    bf16 arithmetic keeps), so one mask; codes 4, 6 and 1, 3 after a rotation; codes 5, 7 are
    masked, placed by one multiply (by 2^3 + 2^8 + 2^14; the shifted copies do not overlap,
    so no carry) and masked again. Then one multiply by the scale: 2^126 * 2^(s - 127) =
    2^(s - 1), a normal bf16 number while s <= 128 (`MXFP4Weight.small_scales`). 12
    instructions per 8 values."""
    return tl.inline_asm_elementwise(
        asm="""
        {
        .reg .b32 t;
        and.b32 t, $4, 0x81C081C0;
        mul.rn.bf16x2 $0, t, $5;
        shf.r.wrap.b32 t, $4, $4, 3;
        and.b32 t, t, 0x81C081C0;
        mul.rn.bf16x2 $1, t, $5;
        shf.r.wrap.b32 t, $4, $4, 6;
        and.b32 t, t, 0x81C081C0;
        mul.rn.bf16x2 $2, t, $5;
        and.b32 t, $4, 0x001B001B;
        mul.lo.u32 t, t, 0x4108;
        and.b32 t, t, 0x81C081C0;
        mul.rn.bf16x2 $3, t, $5;
        }
        """,
        constraints="=r,=r,=r,=r,r,r,r,r,r",
        args=[q, scale],
        dtype=(tl.bfloat16, tl.bfloat16),
        is_pure=True,
        pack=4,
    )


@triton.jit
def _code(word, P_M: tl.constexpr, P_E0: tl.constexpr, P_E1: tl.constexpr, P_S: tl.constexpr):
    """The 4-bit code whose bits m, e0, e1, s sit at those positions of the int32 words."""
    return (((word >> P_M) & 1) | (((word >> P_E0) & 1) << 1) | (((word >> P_E1) & 1) << 2)
            | (((word >> P_S) & 1) << 3))  # fmt: skip


@triton.jit
def _quad(a, b, c, d):
    """[W, N] x 4 -> [4 W, N]: row 4 w + i of the result is row w of the i-th input."""
    x = tl.join(tl.join(a, b), tl.join(c, d))  # [W, N, 2, 2]: [..., i % 2, i // 2]
    x = tl.permute(x, (0, 3, 2, 1))
    return tl.reshape(x, [4 * a.shape[0], a.shape[1]])


@triton.jit
def _words_fp32(q_cols, k0, col_ok, s_cols, K, GROUP: tl.constexpr, BLOCK_K: tl.constexpr,
                BLOCK_N: tl.constexpr):  # fmt: skip
    """The integer path (fp32 activations, and the CPU interpreter): fp32 weights of the even
    and odd inputs [BLOCK_K / 2, BLOCK_N] from the words of the tile at input k0, each code
    read from its `mxfp4.WORD_BITS` positions and times 2^(s - 127)."""
    ww = tl.arange(0, BLOCK_K // 8)  # word within the tile: inputs k0 + 8 ww + 0..7
    w_ok = (k0 // 8 + ww < K // 8)[:, None] & col_ok[None, :]
    byte = q_cols[None, :] + (k0 // 2 + 4 * ww)[:, None]
    word = tl.load(byte, mask=w_ok, other=0).to(tl.int32)
    for i in tl.static_range(1, 4):
        word |= tl.load(byte + i, mask=w_ok, other=0).to(tl.int32) << (8 * i)
    s = tl.load(s_cols[None, :] + (k0 // GROUP + ww // (GROUP // 8))[:, None], mask=w_ok,
                other=127).to(tl.int32)  # fmt: skip
    sb = tl.where(s > 0, s << 23, 1 << 22)  # 2^(s - 127); s = 0: subnormal
    w_even = _quad(_e2m1_times_scale(_code(word, 6, 7, 8, 15), sb),
                   _e2m1_times_scale(_code(word, 22, 23, 24, 31), sb),
                   _e2m1_times_scale(_code(word, 9, 10, 11, 18), sb),
                   _e2m1_times_scale(_code(word, 25, 26, 27, 2), sb))  # fmt: skip
    w_odd = _quad(_e2m1_times_scale(_code(word, 12, 13, 14, 21), sb),
                  _e2m1_times_scale(_code(word, 28, 29, 30, 5), sb),
                  _e2m1_times_scale(_code(word, 3, 4, 0, 1), sb),
                  _e2m1_times_scale(_code(word, 19, 20, 16, 17), sb))  # fmt: skip
    return w_even, w_odd


@triton.jit
def _per_byte(s, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Per-group values [BLOCK_K / GROUP, BLOCK_N] spread over the bytes of their groups:
    [BLOCK_K / 2, BLOCK_N]."""
    s = tl.broadcast_to(s[:, None, :], [BLOCK_K // GROUP, GROUP // 2, BLOCK_N])
    return tl.reshape(s, [BLOCK_K // 2, BLOCK_N])


@triton.jit
def w4a16_grouped_kernel(x_ptr, tok_ptr, q_ptr, s_ptr, out_ptr, offs_ptr, N, K, stride_x,
                         stride_qe, stride_qn, stride_se, stride_sn, stride_out, E, beta,
                         linear_beta, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         BLOCK_E: tl.constexpr, GATHER: tl.constexpr, ACT: tl.constexpr,
                         UPCAST: tl.constexpr, PTX: tl.constexpr, EVEN: tl.constexpr,
                         SMALL_SCALES: tl.constexpr):  # fmt: skip
    """N: the output's columns; with ACT, the weights hold 2 N rows an expert (gate, then up)."""
    expert, first, n_block = program_tile(offs_ptr, E, N, BLOCK_M, BLOCK_N, BLOCK_E)
    if expert < E:
        rows = tl.load(offs_ptr + expert) - first
        if BLOCK_T > 0 and rows <= BLOCK_T:  # an expert's last tile, of few rows
            _w4a16_tile(x_ptr, tok_ptr, q_ptr, s_ptr, out_ptr, offs_ptr, N, K, stride_x,
                        stride_qe, stride_qn, stride_se, stride_sn, stride_out, expert, first,
                        n_block, beta, linear_beta, GROUP, BLOCK_T, BLOCK_N, BLOCK_K, GATHER,
                        ACT, UPCAST, PTX, EVEN, SMALL_SCALES)  # fmt: skip
        else:
            _w4a16_tile(x_ptr, tok_ptr, q_ptr, s_ptr, out_ptr, offs_ptr, N, K, stride_x,
                        stride_qe, stride_qn, stride_se, stride_sn, stride_out, expert, first,
                        n_block, beta, linear_beta, GROUP, BLOCK_M, BLOCK_N, BLOCK_K, GATHER,
                        ACT, UPCAST, PTX, EVEN, SMALL_SCALES)  # fmt: skip


@triton.jit
def _w4a16_tile(x_ptr, tok_ptr, q_ptr, s_ptr, out_ptr, offs_ptr, N, K, stride_x, stride_qe,
                stride_qn, stride_se, stride_sn, stride_out, expert, first, n_block, beta,
                linear_beta, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, GATHER: tl.constexpr, ACT: tl.constexpr,
                UPCAST: tl.constexpr, PTX: tl.constexpr, EVEN: tl.constexpr,
                SMALL_SCALES: tl.constexpr):  # fmt: skip
    """out[rows, cols] of the program's tile: BLOCK_M rows from first (those below the
    expert's end) times BLOCK_N columns of its weights; GATHER: row r reads x's row tok[r].
    ACT (1 SiTU, 2 SwiGLU): act(gate, up) of the columns' gate rows and their up rows (N
    further), each with an accumulator of its own."""
    rows, cols, row_ok, col_ok = tile_rows_cols(first, offs_ptr, expert, n_block, N, BLOCK_M,
                                                BLOCK_N)  # fmt: skip
    kk = tl.arange(0, BLOCK_K)
    if GATHER:
        x_idx = tl.load(tok_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    else:
        x_idx = rows.to(tl.int64)
    x_rows = x_ptr + x_idx[:, None] * stride_x
    q_cols = q_ptr + expert.to(tl.int64) * stride_qe + cols.to(tl.int64) * stride_qn
    s_cols = s_ptr + expert.to(tl.int64) * stride_se + cols.to(tl.int64) * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if ACT > 0:
        up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w_even, w_odd = _weight_tile(q_cols, s_cols, k0, col_ok, K, GROUP, BLOCK_N, BLOCK_K,
                                     PTX, EVEN, SMALL_SCALES)  # fmt: skip
        if EVEN:
            xmask = row_ok[:, None]
        else:
            xmask = row_ok[:, None] & (k0 + kk < K)[None, :]
        x = tl.load(x_rows + (k0 + kk)[None, :], mask=xmask, other=0.0)  # [BLOCK_M, BLOCK_K]
        x_even, x_odd = tl.split(tl.reshape(x, [BLOCK_M, BLOCK_K // 2, 2]))
        if UPCAST:  # the CPU interpreter multiplies bf16 bit patterns as integers
            x_even, x_odd = x_even.to(tl.float32), x_odd.to(tl.float32)
        acc = tl.dot(x_even, w_even.to(x_even.dtype), acc)
        acc = tl.dot(x_odd, w_odd.to(x_odd.dtype), acc)
        if ACT > 0:
            w_even, w_odd = _weight_tile(q_cols + N * stride_qn, s_cols + N * stride_sn, k0,
                                         col_ok, K, GROUP, BLOCK_N, BLOCK_K, PTX, EVEN,
                                         SMALL_SCALES)  # fmt: skip
            up = tl.dot(x_even, w_even.to(x_even.dtype), up)
            up = tl.dot(x_odd, w_odd.to(x_odd.dtype), up)
    if ACT > 0:
        acc = gated(acc, up, beta, linear_beta, ACT == 1, PTX)
    o_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_out + cols[None, :]
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _weight_tile(q_cols, s_cols, k0, col_ok, K, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, PTX: tl.constexpr, EVEN: tl.constexpr,
                 SMALL_SCALES: tl.constexpr):  # fmt: skip
    """The weights of the even and odd inputs [BLOCK_K / 2, BLOCK_N] of the columns at q_cols
    (packed bytes) and s_cols (scales) from input k0: bf16 by the PTX unpacking (bf16
    activations on the GPU), else fp32 by the integer path."""
    if PTX:
        w_even, w_odd = _words_bf16(q_cols, s_cols, k0, col_ok, K, GROUP, BLOCK_N, BLOCK_K,
                                    EVEN, SMALL_SCALES)  # fmt: skip
    else:
        w_even, w_odd = _words_fp32(q_cols, k0, col_ok, s_cols, K, GROUP, BLOCK_K, BLOCK_N)
    return w_even, w_odd


@triton.jit
def _words_bf16(q_cols, s_cols, k0, col_ok, K, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, EVEN: tl.constexpr, SMALL_SCALES: tl.constexpr):  # fmt: skip
    """The PTX path of `_weight_tile`: the tile's packed bytes and scales unpacked by
    `_e2m1_words_bf16`."""
    # Weight tiles [BLOCK_K / 2, BLOCK_N], indices written so that the compiler sees
    # contiguous runs (vector loads): bytes k0/2 + jj.
    jj = tl.arange(0, BLOCK_K // 2)  # byte within the tile: inputs 2 jj and 2 jj + 1
    q_ptrs = q_cols[None, :] + (k0 // 2 + jj)[:, None]
    if EVEN:
        q = tl.load(q_ptrs)
    else:
        q = tl.load(q_ptrs, mask=(k0 // 2 + jj < K // 2)[:, None] & col_ok[None, :], other=0)
    # one scale row per group, as bf16 pairs (s + 126) << 7 in both halves: 2^(s - 1)
    # (the unpacking's 2^-126 folded in), spread over the group's bytes
    gg = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
    s_ptrs = s_cols[None, :] + gg[:, None]
    g_ok = (gg < tl.cdiv(K, GROUP))[:, None] & col_ok[None, :]
    if EVEN:
        s = tl.load(s_ptrs).to(tl.int32)
    else:
        s = tl.load(s_ptrs, mask=g_ok, other=127).to(tl.int32)
    if SMALL_SCALES:
        pair = s * 0x00800080 + 0x3F003F00
    else:  # 2^126 there, then 2^(s - 127) (s = 0: a subnormal) as a second product
        s_exact = tl.where(s > 0, s << 7, 64).to(tl.int16).to(tl.bfloat16, bitcast=True)
        pair = tl.full(s.shape, 0x7E807E80, tl.int32)
    w_even, w_odd = _e2m1_words_bf16(q, _per_byte(pair, GROUP, BLOCK_N, BLOCK_K))
    if not SMALL_SCALES:
        s_exact = _per_byte(s_exact, GROUP, BLOCK_N, BLOCK_K)
        w_even, w_odd = w_even * s_exact, w_odd * s_exact
    return w_even, w_odd


def grouped_mm_mxfp4(x_MK: torch.Tensor, w: MXFP4Weight, offs_E: torch.Tensor,
                     rows_M: torch.Tensor | None = None, act: str | None = None,
                     beta: float = 4.0, linear_beta: float = 25.0,
                     **config) -> torch.Tensor:  # fmt: skip
    """out[r] = x[r] @ dequantize(w[e]).T for the rows r of group e; x [M, K] (unit last
    stride), w: packed [E, N, K/2] (word layout) and scale [E, N, ceil(K/32)] uint8 with unit
    last strides, K a multiple of 8, offs [E] int32 cumulative group ends. Rows after offs[-1]
    are left unwritten. rows_M ([M] int, the sorted rows' rows of x): out[r] = x[rows[r]] @ ...
    instead, x [T, K]: the kernel reads x by pointer loads anyway, so reading each row by index
    costs it one index load per tile and saves the pass a gathered copy of x (a read and a
    write of [T k, D]: 5.6 ms of Kimi Linear's 8K prefill on an H100). act ("situ" or "silu",
    with beta and linear_beta as `moe_act`): w holds gate rows [0, N/2) and up rows [N/2, N)
    an expert and out [M, N/2] = act(gate, up) of the fp32 sums, each program unpacking the
    gate and the up tile of block_n / 2 columns (`grouped_gemm_triton.grouped_mm_triton`'s
    act, the same accumulator size as the unfused tile). config: block_m,
    block_t, block_n, block_k, num_warps, num_stages (default `launch_config`); block_t (0:
    none): an expert's last tile, when it has at most block_t rows, is computed as a tile of
    block_t rows instead of block_m."""
    E, N, K = w.shape
    if x_MK.shape[1] != K or x_MK.stride(-1) != 1:
        raise ValueError(f"x {list(x_MK.shape)} does not match MXFP4 weights of {K} inputs "
                         f"(or its last stride is not 1)")  # fmt: skip
    if w.packed.stride(-1) != 1 or w.scale.stride(-1) != 1 or K % 8:
        raise ValueError(f"MXFP4 packed values and scales need unit last strides and a width "
                         f"that is a multiple of 8 (K = {K})")  # fmt: skip
    if act is not None and (act not in ACTS or N % 2):
        raise ValueError(f"grouped_mm_mxfp4's act is one of {', '.join(ACTS)} over an even "
                         f"number of weight rows (gate, then up); got {act!r} and {N} "
                         f"rows")  # fmt: skip
    gather = rows_M is not None
    M = rows_M.shape[0] if gather else x_MK.shape[0]
    cfg = launch_config(M, E, "mxfp4", nk=(N, K)) | config
    block_n = cfg["block_n"]
    if act is not None:  # the output's columns, each program's from two tiles of block_n rows
        N, block_n = N // 2, block_n // 2
    if cfg["block_k"] % GROUP_SIZE:
        raise ValueError(f"block_k = {cfg['block_k']} must be a multiple of {GROUP_SIZE}")
    block_t = cfg.get("block_t", 0)
    if block_t >= cfg["block_m"]:
        raise ValueError(f"block_t = {block_t} must be under block_m = {cfg['block_m']}")
    out = torch.empty(M, N, dtype=x_MK.dtype, device=x_MK.device)
    if M == 0:
        return out
    grid = (num_tile_slots(M, E, cfg["block_m"]) * triton.cdiv(N, block_n),)
    w4a16_grouped_kernel[grid](
        x_MK, rows_M if gather else offs_E, w.packed, w.scale, out, offs_E, N, K, x_MK.stride(0),
        w.packed.stride(0), w.packed.stride(1), w.scale.stride(0), w.scale.stride(1),
        out.stride(0), E, float(beta), float(linear_beta), GROUP=GROUP_SIZE,
        BLOCK_M=cfg["block_m"], BLOCK_T=block_t, BLOCK_N=block_n,
        BLOCK_K=cfg["block_k"], BLOCK_E=block_e(E), GATHER=gather, ACT=ACTS.get(act, 0),
        UPCAST=INTERPRETED and x_MK.dtype != torch.float32,
        PTX=not INTERPRETED and x_MK.dtype == torch.bfloat16,
        EVEN=K % cfg["block_k"] == 0 and N % block_n == 0, SMALL_SCALES=w.small_scales,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    return out
