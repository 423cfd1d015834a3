"""Log-sum-exp merge of N partial attentions (split-K partials of one decode, or the DCP
ranks' partials of one step): out = sum_j exp(lse_j - lse) partial_j, lse = log sum_j
exp(lse_j). fp32 math; -inf partials weigh 0. Reference: `reference.merge_lse`.

Shape legend: N partials, R rows (flattened batch x heads), L latent.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def lse_merge_kernel(
    part_ptr,  # [N, R, L]
    lse_ptr,  # [N, R] natural log
    out_ptr,  # [R, L]
    out_lse_ptr,  # [R]
    N,
    L,
    stride_pn,
    stride_pr,
    stride_ln,
    stride_lr,
    stride_or,
    BLOCK_N: tl.constexpr,
    BLOCK_L: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    n = tl.arange(0, BLOCK_N)
    lse = tl.load(lse_ptr + n * stride_ln + r * stride_lr, mask=n < N, other=-float("inf"))
    lse2 = lse.to(tl.float32) * 1.4426950408889634  # log2 domain
    top = tl.max(lse2, axis=0)
    top = tl.where(top == -float("inf"), 0.0, top)
    w = tl.exp2(lse2 - top)  # [BLOCK_N], 0 for empty partials
    total = tl.sum(w, axis=0)
    inv = 1.0 / tl.maximum(total, 1e-30)  # all-empty rows: w = 0, so out = 0
    for l0 in range(0, L, BLOCK_L):
        offs = l0 + tl.arange(0, BLOCK_L)
        mask = (n[:, None] < N) & (offs[None, :] < L)
        p = tl.load(
            part_ptr + n[:, None] * stride_pn + r * stride_pr + offs[None, :], mask=mask, other=0.0
        ).to(tl.float32)
        acc = tl.sum(w[:, None] * p, axis=0) * inv
        tl.store(out_ptr + r * stride_or + offs, acc.to(out_ptr.dtype.element_ty), mask=offs < L)
    lse_out = (top + tl.log2(tl.maximum(total, 1e-30))) * 0.6931471805599453
    tl.store(out_lse_ptr + r, tl.where(total > 0, lse_out, -float("inf")))


def merge_lse(partials_NRL, lses_NR, *, out_dtype=None):
    """partials [N, ..., L] (last dim contiguous), lses [N, ...] -> (out [..., L] in out_dtype
    (default the partials' dtype), lse [...] fp32). Same math as `reference.merge_lse`."""
    N, L = partials_NRL.shape[0], partials_NRL.shape[-1]
    batch_shape = partials_NRL.shape[1:-1]
    part = partials_NRL.reshape(N, -1, L)  # a view where the strides allow
    lse = lses_NR.reshape(N, -1)
    if part.stride(-1) != 1:
        part = part.contiguous()
    R = part.shape[1]
    out = torch.empty(R, L, device=part.device, dtype=out_dtype or partials_NRL.dtype)
    out_lse = torch.empty(R, device=part.device, dtype=torch.float32)
    if R:
        lse_merge_kernel[(R,)](
            part, lse, out, out_lse, N, L,
            part.stride(0), part.stride(1), lse.stride(0), lse.stride(1), out.stride(0),
            BLOCK_N=max(2, triton.next_power_of_2(N)),
            BLOCK_L=min(512, triton.next_power_of_2(L)),
        )  # fmt: skip
    return out.view(*batch_shape, L), out_lse.view(*batch_shape)
