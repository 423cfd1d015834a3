"""One decode step of the KDA short convolution, in place on the cache (Triton).

For N sequences with one new token each, reads each sequence's conv state straight from its
KDA block (`slots`), writes y = SiLU(sum_j w[:, j] x_{t-W+1+j}) and shifts the new input into the
state, in the same slot. No gather, no new state tensor: the graph-capturable decode path.
The oracle is `reference.short_conv_decode_`.

Shape legend: N sequences, C channels, W conv width, NB blocks of the arena.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def short_conv_decode_kernel(
    x,  # [N, C]
    y,  # [N, C]
    pool,  # [NB, C, W-1] view (stride_pb, stride_pc, 1)
    slots,  # [N] int
    weight,  # [C, W] fp32, contiguous
    stride_x,
    stride_y,
    stride_pb,
    stride_pc,
    C,
    W: tl.constexpr,
    BW: tl.constexpr,
    BC: tl.constexpr,
):
    i_n, i_c = tl.program_id(0), tl.program_id(1)
    o_c = i_c * BC + tl.arange(0, BC)
    o_w = tl.arange(0, BW)
    m_c = o_c < C
    slot = tl.load(slots + i_n).to(tl.int64)
    p_state = pool + slot * stride_pb + o_c[:, None] * stride_pc + o_w[None, :]
    m_state = m_c[:, None] & (o_w < W - 1)[None, :]
    b_state = tl.load(p_state, mask=m_state, other=0.0).to(tl.float32)  # [BC, BW], oldest first
    b_x = tl.load(x + i_n * stride_x + o_c, mask=m_c, other=0.0)
    m_w = m_c[:, None] & (o_w < W)[None, :]
    b_w = tl.load(weight + o_c[:, None] * W + o_w[None, :], mask=m_w, other=0.0)
    # window = [state_0 .. state_{W-2}, x]; column W-1 of the weight multiplies x.
    b_win = tl.where((o_w == W - 1)[None, :], b_x.to(tl.float32)[:, None], b_state)
    b_y = tl.sum(b_win * b_w.to(tl.float32), axis=1)
    b_y = b_y * tl.sigmoid(b_y)
    tl.store(y + i_n * stride_y + o_c, b_y.to(y.dtype.element_ty), mask=m_c)
    # New state: window columns 1 .. W-1. Shift left by one column through a one-hot product
    # (Triton has no register gather): new[:, j] = win[:, j + 1].
    shift = o_w[:, None] == (o_w[None, :] + 1)  # [BW src, BW dst]: src == dst + 1
    b_new = tl.sum(b_win[:, :, None] * shift[None, :, :].to(tl.float32), axis=1)
    tl.store(p_state, b_new.to(pool.dtype.element_ty), mask=m_state)


def short_conv_decode_(x_NC, weight_CW, pool_BCW, slots_N):
    """x_NC: [N, C] one token per sequence; weight_CW: [C, W]; pool_BCW: [NB, C, W-1] (a view
    into the arena, last dim contiguous), updated in place at rows `slots_N` (distinct int
    indices, on the device). Returns y [N, C] in x's dtype."""
    N, C = x_NC.shape
    W = weight_CW.shape[1]
    assert pool_BCW.shape[1:] == (C, W - 1) and pool_BCW.stride(2) == 1
    x = x_NC if x_NC.stride(1) == 1 else x_NC.contiguous()
    y = torch.empty_like(x)
    BC = 128
    short_conv_decode_kernel[(N, triton.cdiv(C, BC))](
        x,
        y,
        pool_BCW,
        slots_N,
        weight_CW.float().contiguous(),
        x.stride(0),
        y.stride(0),
        pool_BCW.stride(0),
        pool_BCW.stride(1),
        C,
        W=W,
        BW=triton.next_power_of_2(W),
        BC=BC,
    )
    return y
