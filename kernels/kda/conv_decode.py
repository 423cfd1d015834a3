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
    weight,  # [C, W], contiguous
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
    # The new state is the window's columns 1 .. W-1: the old state read again one column on,
    # then x in the last column.
    m_next = m_c[:, None] & (o_w < W - 2)[None, :]
    b_next = tl.load(p_state + 1, mask=m_next, other=0.0)
    b_x = tl.load(x + i_n * stride_x + o_c, mask=m_c, other=0.0)
    m_w = m_c[:, None] & (o_w < W)[None, :]
    b_w = tl.load(weight + o_c[:, None] * W + o_w[None, :], mask=m_w, other=0.0)
    # window = [state_0 .. state_{W-2}, x]; column W-1 of the weight multiplies x.
    b_win = tl.where((o_w == W - 1)[None, :], b_x.to(tl.float32)[:, None], b_state)
    b_y = tl.sum(b_win * b_w.to(tl.float32), axis=1)
    b_y = b_y * tl.sigmoid(b_y)
    tl.store(y + i_n * stride_y + o_c, b_y.to(y.dtype.element_ty), mask=m_c)
    b_new = tl.where((o_w == W - 2)[None, :], b_x[:, None].to(pool.dtype.element_ty),
                     b_next.to(pool.dtype.element_ty))  # fmt: skip
    tl.debug_barrier()  # every thread has read the state before any overwrites it
    tl.store(p_state, b_new, mask=m_state)


def short_conv_decode_(x_NC, weight_CW, pool_BCW, slots_N, block_c: int | None = None):
    """x_NC: [N, C] one token per sequence, any row stride (the model's q|k|v columns of its
    fused projection: C = 3 H K); weight_CW: [C, W] (any float dtype, read as is);
    pool_BCW: [NB, C, W-1] (a view into the arena, last dim contiguous), updated in place at
    rows `slots_N` (distinct int indices, on the device). Returns y [N, C] in x's dtype.
    block_c: channels per program (default: 512, or 256 for fewer than 64 sequences, so that a
    small batch still spreads over the GPU: the fastest of 128-2,048 on an H200 at 12,288
    channels (K3's q, k or v alone, as it was launched then) and 1, 16, 64 and 256 sequences)."""
    N, C = x_NC.shape
    W = weight_CW.shape[1]
    assert pool_BCW.shape[1:] == (C, W - 1) and pool_BCW.stride(2) == 1
    x = x_NC if x_NC.stride(1) == 1 else x_NC.contiguous()
    y = torch.empty_like(x)
    BC = block_c or (256 if N < 64 else 512)
    short_conv_decode_kernel[(N, triton.cdiv(C, BC))](
        x,
        y,
        pool_BCW,
        slots_N,
        weight_CW.contiguous(),
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
