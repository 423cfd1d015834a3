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
block, sequence) computes BLOCK_T outputs, each from W shifted loads that read the old state
where they reach before the first token (a block wholly inside the sequence, past its first
W-1 tokens, skips those loads and the token masks); it writes only y. (A first version walked
each sequence in one program per channel block: 96 programs for one 8,192-token sequence at K3's
12,288 channels, 0.65 ms per call on an H200, 6% of a prefill.) `conv_state_update_kernel`
then runs once per (channel block, sequence): it reads the old state and the last inputs,
and writes the new state; no other program touches those channels of that block, so the
update is race-free. The conv sums fp32 products; the state is copied exactly.

Shape legend: T packed tokens, N sequences, C channels, W conv width, NB blocks of the arena.
"""

from pathlib import Path

import torch
import triton
import triton.language as tl
from k3kernels import tuned
from k3kernels.kda.varlen import as_varlen

# Launch settings by default: the best of 18 on one H200 with the interior path (12,288 bf16
# channels in one part, no norm, 1 x 8,192 and 4 x 2,048 tokens, within 1% of the best at both):
# 0.265 ms as timed with the host's launch, against 0.328 before that path and 0.58 for fla's
# causal_conv1d with the state gathered and scattered around it (benchmarks/kernels_h200.txt).
# The tuned table (`k3kernels.tuned`: table "conv_prefill" of tuned/<GPU>.json, keys
# `table_key`, written by `k3batch bench kda-prefill --sweep --save-tuned` at the model's call:
# q|k|v in three parts, q and k normed) overrides them at its shapes.
BLOCK_T = 32
BLOCK_C = 256
NUM_WARPS = 4
TUNED_DIR = Path(__file__).with_name("tuned")


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
    if i_t * BT < T:
        slot = tl.load(slots + i_n).to(tl.int64)
        # First state column to read: 1 - W (all of it) when warm, else none (src >= 0 only).
        first = tl.where(tl.load(warm + i_n) != 0, 1 - W, 0)
        o_c = i_c * BC + tl.arange(0, BC)
        m_c = o_c < C
        p_state = pool + slot * stride_pb + o_c * stride_pc  # [BC], column 0 of the state
        o_t = i_t * BT + tl.arange(0, BT)
        m_t = o_t < T
        acc = tl.zeros([BT, BC], dtype=tl.float32)
        if (i_t * BT >= W - 1) & (i_t * BT + BT <= T):  # every input in x: no state, no t mask
            for j in tl.static_range(W):
                p_x = x + (bos + o_t - (W - 1) + j)[:, None] * stride_x + o_c[None, :]
                b_x = tl.load(p_x, mask=m_c[None, :], other=0.0)
                b_w = tl.load(weight + o_c * W + j, mask=m_c, other=0.0)
                acc += b_x.to(tl.float32) * b_w[None, :]
        else:
            for j in tl.static_range(W):
                src = o_t - (W - 1) + j
                in_x = src >= 0
                m_x = (m_t & in_x)[:, None] & m_c[None, :]
                p_x = x + (bos + src)[:, None] * stride_x + o_c[None, :]
                b_x = tl.load(p_x, mask=m_x, other=0.0)
                m_s = (m_t & (src < 0) & (src >= first))[:, None] & m_c[None, :]
                p_s = p_state[None, :] + (src + W - 1)[:, None] * stride_pw
                b_s = tl.load(p_s, mask=m_s, other=0.0).to(b_x.dtype)  # state read in x's dtype
                b_w = tl.load(weight + o_c * W + j, mask=m_c, other=0.0)
                acc += tl.where(in_x[:, None], b_x, b_s).to(tl.float32) * b_w[None, :]
        b_y = tl.fdiv(acc, 1.0 + tl.exp(-acc))  # SiLU; the approximate quotient (2 ulp)
        part = (o_c // CP).to(tl.int64)  # per channel, not per element
        if NORM_PARTS > 0:  # each head's L2 norm in the first parts (heads lie inside blocks)
            b_h = tl.reshape(b_y, [BT, BC // HEAD, HEAD])
            r = 1.0 / tl.sqrt(tl.sum(b_h * b_h, axis=2) + 1e-6)  # [BT, BC // HEAD]
            b_n = tl.reshape(b_h * r[:, :, None], [BT, BC])
            b_y = tl.where((part < NORM_PARTS)[None, :], b_n, b_y)
        p_y = y + (part * stride_yp + o_c - part * CP)[None, :] + (bos + o_t)[:, None] * CP
        tl.store(p_y, b_y.to(y.dtype.element_ty), mask=m_t[:, None] & m_c[None, :])


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
