"""The KDA short convolution over a packed prefill batch, in place on the cache (Triton).

For each sequence n of the batch: y_t = SiLU(sum_j w[:, j] x_{t-W+1+j}), where inputs before
the sequence's first new token come from its conv state, the previous W-1 inputs kept in its
KDA block (`pool[slots[n]]`; zeros when `warm[n] == 0`, since a fresh sequence's block holds
stale bytes). The block is then overwritten with the last W-1 inputs of the window
[old state, new tokens], so a sequence shorter than W-1 tokens keeps part of its old state,
shifted. No gather, no new state tensor, no host read. The output is laid out in parts
[P, T, C / P], channel c in part c // (C / P): the model convolves q, k and v as one
3C-channel input (the q|k|v columns of its fused projection, a strided view) and gets three
contiguous [T, C] tensors, as the chunked KDA kernels take them; with `norm_parts` the first
parts (q and k) leave L2-normed over each head, as KDA takes them, so that the two norm passes
over q and k (a read and a write of [T, C] each, 20 a Kimi Linear prefill) do not follow. The
oracle is `reference.short_conv_prefill_`.

Two launches, in stream order. `short_conv_prefill_kernel`: program (channel block, token
block, sequence) walks BLOCK_T tokens in steps of 8 rows, keeping the last W-1 input rows
(the window) in registers: each row of x is read from memory once (the window's first rows come
from x or, before the sequence's first token, from its old state), and a step's 8 loads are
issued before its first output (a store there would keep the next load behind it: the compiler
cannot know that x and y do not overlap); it writes only y. W is at most 4 (K3's and Kimi
Linear's width). (Earlier versions: one program walking a whole sequence per channel block,
96 programs for one 8,192-token sequence at K3's 12,288 channels, 0.65 ms per call on an H200;
then a [BLOCK_T, BLOCK_C] tile from W shifted loads of x, 0.265 ms there and 0.311 ms on an
H100 at Kimi Linear's call with q and k normed, each input row read W times, 211 registers a
thread.)
`conv_state_update_kernel` then runs once per (channel block, sequence): it reads the old state
and the last inputs, and writes the new state; no other program touches those channels of that
block, so the update is race-free. The conv sums fp32 products; the state is copied exactly.

Shape legend: T packed tokens, N sequences, C channels, W conv width, NB blocks of the arena.
"""

from pathlib import Path

import torch
import triton
import triton.language as tl
from k3kernels import tuned
from k3kernels.kda.varlen import as_varlen

# Launch settings by default: the best of 18 on one H100 at Kimi Linear's call (12,288 bf16
# channels in 3 parts, q and k normed, 1 x 8,192 and 8 x 1,024 tokens): 0.164 ms, 83% of the
# copy bandwidth on the bytes it must move, against 0.311 for the earlier shifted-tile kernel
# (benchmarks/kernel_sweeps_kimi_linear_h100.txt). The tuned table (`k3kernels.tuned`: table
# "conv_prefill" of tuned/<GPU>.json, keys `table_key`, written by `k3batch bench kda-prefill
# --sweep --save-tuned`) overrides them at its shapes.
BLOCK_T = 64
BLOCK_C = 512
NUM_WARPS = 4
TUNED_DIR = Path(__file__).with_name("tuned")


@triton.jit
def _input_row(x, bos, src, stride_x, o_c, m_c, p_state, stride_pw, first, W: tl.constexpr):
    """Input row src of a sequence ([BC] channels): x's where src >= 0, else the conv state's
    column src + W - 1 where src >= first (a warm sequence), else zeros."""
    src_c = src + tl.zeros_like(o_c)  # masks as vectors (the interpreter refuses scalar ones)
    b_x = tl.load(x + (bos + src) * stride_x + o_c, mask=m_c & (src_c >= 0), other=0.0)
    m_s = m_c & (src_c < 0) & (src_c >= first)
    b_s = tl.load(p_state + (src + W - 1) * stride_pw, mask=m_s, other=0.0)
    return tl.where(src_c >= 0, b_x, b_s.to(b_x.dtype))  # the state read in x's dtype


@triton.jit
def short_conv_prefill_kernel(
    x,  # [T, C], unit channel stride
    y,  # [P, T, CP] out, contiguous: channel c at part c // CP, column c % CP
    pool,  # [NB, C, W-1] view (stride_pb, stride_pc, stride_pw)
    slots,  # [N] int
    warm,  # [N] int or bool: nonzero where the block holds the state to continue from
    weight,  # [C, W] fp32, contiguous
    cu_seqlens,  # [N + 1] int64
    stride_x,
    stride_yp,
    stride_pb,
    stride_pc,
    stride_pw,
    C,
    CP,
    W: tl.constexpr,
    BT: tl.constexpr,
    BC: tl.constexpr,
    NORM_PARTS: tl.constexpr,
    HEAD: tl.constexpr,
):
    i_c, i_t, i_n = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    T = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
    t0 = i_t * BT
    if t0 < T:
        slot = tl.load(slots + i_n).to(tl.int64)
        # First state column to read: 1 - W (all of it) when warm, else none (src >= 0 only).
        first = tl.where(tl.load(warm + i_n) != 0, 1 - W, 0)
        o_c = i_c * BC + tl.arange(0, BC)
        m_c = o_c < C
        p_state = pool + slot * stride_pb + o_c * stride_pc  # [BC], column 0 of the state
        # The taps, oldest input first: w_j multiplies x_{t-W+1+j} (widths under 4 have zeros
        # for the missing oldest taps, and their rows are never read).
        w_3 = tl.load(weight + o_c * W + W - 1, mask=m_c, other=0.0)
        w_0, w_1, w_2 = tl.zeros_like(w_3), tl.zeros_like(w_3), tl.zeros_like(w_3)
        if W >= 4:
            w_0 = tl.load(weight + o_c * W + W - 4, mask=m_c, other=0.0)
        if W >= 3:
            w_1 = tl.load(weight + o_c * W + W - 3, mask=m_c, other=0.0)
        if W >= 2:
            w_2 = tl.load(weight + o_c * W + W - 2, mask=m_c, other=0.0)
        # The window: the W-1 inputs before the block's first token (x_{t-3}, x_{t-2}, x_{t-1})
        a_3 = _input_row(x, bos, t0 - 3, stride_x, o_c, m_c, p_state, stride_pw, first, W)
        a_2 = _input_row(x, bos, t0 - 2, stride_x, o_c, m_c, p_state, stride_pw, first, W)
        a_1 = _input_row(x, bos, t0 - 1, stride_x, o_c, m_c, p_state, stride_pw, first, W)
        part = (o_c // CP).to(tl.int64)  # per channel, not per element
        p_y = y + part * stride_yp + o_c - part * CP + bos * CP  # [BC], the sequence's row 0
        normed = part < NORM_PARTS
        for t in range(t0, t0 + BT, 8):  # 8 rows a step: their loads first, all in flight
            p_x = x + (bos + t) * stride_x + o_c
            b_0 = _row(p_x, 0, stride_x, t, T, m_c)
            b_1 = _row(p_x, 1, stride_x, t, T, m_c)
            b_2 = _row(p_x, 2, stride_x, t, T, m_c)
            b_3 = _row(p_x, 3, stride_x, t, T, m_c)
            b_4 = _row(p_x, 4, stride_x, t, T, m_c)
            b_5 = _row(p_x, 5, stride_x, t, T, m_c)
            b_6 = _row(p_x, 6, stride_x, t, T, m_c)
            b_7 = _row(p_x, 7, stride_x, t, T, m_c)
            _out_row(p_y, 0, CP, t, T, m_c, a_3, a_2, a_1, b_0, w_0, w_1, w_2, w_3, normed,
                     NORM_PARTS, HEAD)
            _out_row(p_y, 1, CP, t, T, m_c, a_2, a_1, b_0, b_1, w_0, w_1, w_2, w_3, normed,
                     NORM_PARTS, HEAD)
            _out_row(p_y, 2, CP, t, T, m_c, a_1, b_0, b_1, b_2, w_0, w_1, w_2, w_3, normed,
                     NORM_PARTS, HEAD)
            _out_row(p_y, 3, CP, t, T, m_c, b_0, b_1, b_2, b_3, w_0, w_1, w_2, w_3, normed,
                     NORM_PARTS, HEAD)
            _out_row(p_y, 4, CP, t, T, m_c, b_1, b_2, b_3, b_4, w_0, w_1, w_2, w_3, normed,
                     NORM_PARTS, HEAD)
            _out_row(p_y, 5, CP, t, T, m_c, b_2, b_3, b_4, b_5, w_0, w_1, w_2, w_3, normed,
                     NORM_PARTS, HEAD)
            _out_row(p_y, 6, CP, t, T, m_c, b_3, b_4, b_5, b_6, w_0, w_1, w_2, w_3, normed,
                     NORM_PARTS, HEAD)
            _out_row(p_y, 7, CP, t, T, m_c, b_4, b_5, b_6, b_7, w_0, w_1, w_2, w_3, normed,
                     NORM_PARTS, HEAD)
            a_3, a_2, a_1 = b_5, b_6, b_7


@triton.jit
def _row(p_x, r, stride_x, t, T, m_c):
    """Input row t + r ([BC] channels; zeros past the sequence's end)."""
    m_t = m_c & (t + r + tl.zeros_like(m_c.to(tl.int32)) < T)  # a vector mask (interpreter)
    return tl.load(p_x + r * stride_x, mask=m_t, other=0.0)


@triton.jit
def _out_row(p_y, r, CP, t, T, m_c, x_3, x_2, x_1, x_0, w_0, w_1, w_2, w_3, normed,
             NORM_PARTS: tl.constexpr, HEAD: tl.constexpr):  # fmt: skip
    """Output row t + r from its inputs x_{t+r-3} ... x_{t+r}: SiLU of the taps' fp32 sum, each
    head L2-normed where `normed` (channels of the first NORM_PARTS parts)."""
    acc = x_3.to(tl.float32) * w_0 + x_2.to(tl.float32) * w_1
    acc += x_1.to(tl.float32) * w_2 + x_0.to(tl.float32) * w_3
    b_y = tl.fdiv(acc, 1.0 + tl.exp(-acc))  # SiLU; the approximate quotient (2 ulp)
    if NORM_PARTS > 0:  # heads lie inside blocks
        BC: tl.constexpr = b_y.shape[0]
        b_h = tl.reshape(b_y, [BC // HEAD, HEAD])
        r_h = 1.0 / tl.sqrt(tl.sum(b_h * b_h, axis=1) + 1e-6)  # [BC // HEAD]
        b_y = tl.where(normed, tl.reshape(b_h * r_h[:, None], [BC]), b_y)
    m_t = m_c & (t + r + tl.zeros_like(m_c.to(tl.int32)) < T)
    tl.store(p_y + (t + r) * CP, b_y.to(p_y.dtype.element_ty), mask=m_t)


@triton.jit
def conv_state_update_kernel(
    x, pool, slots, warm, cu_seqlens, stride_x, stride_pb, stride_pc, stride_pw, C,
    W: tl.constexpr, BW: tl.constexpr, BC: tl.constexpr,
):  # fmt: skip
    """The new state of (channel block, sequence): the last W-1 inputs of [old state, x]."""
    i_c, i_n = tl.program_id(0), tl.program_id(1)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    T = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
    slot = tl.load(slots + i_n).to(tl.int64)
    first = tl.where(tl.load(warm + i_n) != 0, 1 - W, 0)
    o_c = i_c * BC + tl.arange(0, BC)
    m_c = o_c < C
    p_state = pool + slot * stride_pb + o_c * stride_pc
    o_w = tl.arange(0, BW)
    m_w = o_w < W - 1
    src = T - (W - 1) + o_w
    in_x = src >= 0
    m_x = m_c[:, None] & (m_w & in_x)[None, :]
    b_x = tl.load(x + (bos + src)[None, :] * stride_x + o_c[:, None], mask=m_x, other=0.0)
    m_s = m_c[:, None] & (m_w & (src < 0) & (src >= first))[None, :]
    p_old = p_state[:, None] + (src + W - 1)[None, :] * stride_pw
    b_old = tl.load(p_old, mask=m_s, other=0.0).to(b_x.dtype)
    b_new = tl.where(in_x[None, :], b_x, b_old)  # [BC, BW]
    tl.debug_barrier()  # every thread has read the old state before any overwrites it
    p_new = p_state[:, None] + o_w[None, :] * stride_pw
    tl.store(p_new, b_new.to(pool.dtype.element_ty), mask=m_c[:, None] & m_w[None, :])


def table_key(num_tokens: int, channels: int, width: int, num_parts: int = 1,
              norm_parts: int = 0) -> str:  # fmt: skip
    """The tuned-table key of a conv over num_tokens packed tokens: channels, width and the
    output's parts (normed ones first); the tokens as its size."""
    shape = f"C={channels} W={width} parts={num_parts} norm={norm_parts}"
    return tuned.make_key(shape, "tokens", num_tokens)


def launch_config(num_tokens: int, channels: int, width: int, num_parts: int = 1,
                  norm_parts: int = 0) -> dict:  # fmt: skip
    """{block_t, block_c, num_warps}: the current GPU's tuned entry for this shape at the
    nearest token count, else the defaults above."""
    key = table_key(num_tokens, channels, width, num_parts, norm_parts)
    found = tuned.lookup(tuned.gpu_path(TUNED_DIR), "conv_prefill", key)
    return dict(block_t=BLOCK_T, block_c=BLOCK_C, num_warps=NUM_WARPS) | found


def short_conv_prefill_(x_TC, weight_CW, pool_BCW, slots_N, warm_N, cu_seqlens, *,
                        num_parts: int = 1, norm_parts: int = 0, head_dim: int = 0,
                        block_t: int = BLOCK_T, block_c: int = BLOCK_C,
                        num_warps: int = NUM_WARPS):  # fmt: skip
    """Causal depthwise conv + SiLU over a packed batch, continuing each sequence from its conv
    state in place.

    x_TC: [T, C], any row stride; weight_CW: [C, W] (column W-1 multiplies the current token);
    pool_BCW: [NB, C, W-1] (a view into the arena, any strides), read and overwritten at rows
    `slots_N` (distinct int device indices); warm_N: [N] device ints or bools (0: start from
    zeros); cu_seqlens: N+1 offsets, a host list or a `Varlen` (its device copy reused).
    Returns y [num_parts, T, C / num_parts] in x's dtype (channel c in part c // (C /
    num_parts)); the first norm_parts parts L2-normed over each head's head_dim channels (q
    and k), in fp32 before the one rounding, so that no norm pass follows. A head's channels
    must lie in one program's block: head_dim a power of two dividing block_c and the part.
    """
    T, C = x_TC.shape
    W = weight_CW.shape[1]
    assert pool_BCW.shape[1:] == (C, W - 1)
    if not 1 <= W <= 4:
        raise ValueError(f"conv width {W}: the prefill kernel keeps a window of up to 3 rows")
    if block_t % 8:
        raise ValueError(f"block_t {block_t}: the kernel walks tokens 8 at a time")
    if C % num_parts:
        raise ValueError(f"{C} channels do not split into {num_parts} parts")
    if norm_parts and not (head_dim & (head_dim - 1) == 0 and head_dim and block_c % head_dim == 0
                           and C // num_parts % head_dim == 0 and norm_parts <= num_parts):
        raise ValueError(f"the L2 norm of {norm_parts} of {num_parts} parts of {C} channels "
                         f"needs heads of a power of two dividing the block ({block_c}) and a "
                         f"part; got {head_dim}")  # fmt: skip
    x = x_TC if x_TC.stride(1) == 1 else x_TC.contiguous()
    y = torch.empty(num_parts, T, C // num_parts, dtype=x.dtype, device=x.device)
    N = len(cu_seqlens) - 1
    if N == 0:
        return y
    varlen = as_varlen(cu_seqlens, x.device)
    cu, max_len = varlen.cu, varlen.max_len
    weight = weight_CW.float().contiguous()
    common = (slots_N, warm_N)
    short_conv_prefill_kernel[(triton.cdiv(C, block_c), triton.cdiv(max_len, block_t), N)](
        x, y, pool_BCW, *common, weight, cu, x.stride(0), y.stride(0), *pool_BCW.stride(), C,
        C // num_parts, W=W, BT=block_t, BC=block_c, NORM_PARTS=norm_parts,
        HEAD=head_dim if norm_parts else 1, num_warps=num_warps,
    )  # fmt: skip
    conv_state_update_kernel[(triton.cdiv(C, block_c), N)](
        x, pool_BCW, *common, cu, x.stride(0), *pool_BCW.stride(), C, W=W,
        BW=triton.next_power_of_2(W - 1), BC=block_c,
    )  # fmt: skip
    return y
