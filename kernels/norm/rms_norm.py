"""RMSNorm in one pass per row (oracle: `reference.rms_norm_reference`).

One program per row: the sum of squares over D in BLOCK_D chunks (fp32), then the normalized
row is rounded to x's dtype and multiplied by the weight in fp32 and rounded again, which is
what the torch module computes (so the bf16 results agree up to the order of the sum).
With a residual the program first forms s = x + residual, rounded to x's dtype as torch's add
rounds it, and writes s beside norm(s): the pre-norm residual step `h = h + a; norm(h)` in one
pass where it took two kernels (an add, then the norm reading h again).
Shape legend: R rows (all leading dims), D normalized width.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def rms_norm_kernel(x_ptr, res_ptr, sum_ptr, w_ptr, out_ptr, stride_x, stride_res, stride_sum,
                    stride_out, D, eps, BLOCK_D: tl.constexpr, ONE_BLOCK: tl.constexpr,
                    RESIDUAL: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    out_row = out_ptr + row * stride_out
    if ONE_BLOCK:  # the row fits in registers: read it once
        d = tl.arange(0, BLOCK_D)
        m = d < D
        x = tl.load(x_row + d, mask=m, other=0.0).to(tl.float32)
        if RESIDUAL:
            x += tl.load(res_ptr + row * stride_res + d, mask=m, other=0.0).to(tl.float32)
            x = x.to(out_ptr.dtype.element_ty)
            tl.store(sum_ptr + row * stride_sum + d, x, mask=m)
            x = x.to(tl.float32)
        r = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
        y = (x * r).to(out_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(w_ptr + d, mask=m, other=0.0).to(tl.float32)
        tl.store(out_row + d, (w * y).to(out_ptr.dtype.element_ty), mask=m)
    else:
        ss = tl.zeros([BLOCK_D], dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            d = d0 + tl.arange(0, BLOCK_D)
            x = tl.load(x_row + d, mask=d < D, other=0.0).to(tl.float32)
            if RESIDUAL:  # the second pass reads the rounded sum back
                x += tl.load(res_ptr + row * stride_res + d, mask=d < D, other=0.0).to(tl.float32)
                x = x.to(out_ptr.dtype.element_ty)
                tl.store(sum_ptr + row * stride_sum + d, x, mask=d < D)
                x = x.to(tl.float32)
            ss += x * x
        if RESIDUAL:
            x_row = sum_ptr + row * stride_sum
            tl.debug_barrier()  # this row's sum is written before the second pass reads it
        r = tl.rsqrt(tl.sum(ss, axis=0) / D + eps)
        for d0 in range(0, D, BLOCK_D):
            d = d0 + tl.arange(0, BLOCK_D)
            m = d < D
            x = tl.load(x_row + d, mask=m, other=0.0).to(tl.float32)
            y = (x * r).to(out_ptr.dtype.element_ty).to(tl.float32)
            w = tl.load(w_ptr + d, mask=m, other=0.0).to(tl.float32)
            tl.store(out_row + d, (w * y).to(out_ptr.dtype.element_ty), mask=m)


def rms_norm(x, weight_D, eps: float, *, residual=None, block_d: int = 8192):
    """RMSNorm over the last dim of x [..., D] with weight [D] of x's dtype; returns x's shape
    and dtype. With residual (x's shape and dtype): (norm(s), s) for s = x + residual.
    `block_d`: the widest row read in one block (wider rows take two passes)."""
    if weight_D.dtype != x.dtype:
        raise ValueError(f"rms_norm: weight dtype {weight_D.dtype} != input dtype {x.dtype}")
    D = x.shape[-1]
    x2, res = (t.reshape(-1, D) for t in (x, x if residual is None else residual))
    x2, res = (t if t.stride(-1) == 1 else t.contiguous() for t in (x2, res))
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"rms_norm: residual {list(residual.shape)} {residual.dtype} is not "
                         f"x's {list(x.shape)} {x.dtype}")  # fmt: skip
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    total = out if residual is None else torch.empty_like(out)
    if x2.shape[0]:
        BLOCK_D = min(triton.next_power_of_2(D), block_d)
        rms_norm_kernel[(x2.shape[0],)](
            x2, res, total, weight_D, out, x2.stride(0), res.stride(0), total.stride(0),
            out.stride(0), D, float(eps), BLOCK_D=BLOCK_D, ONE_BLOCK=BLOCK_D >= D,
            RESIDUAL=residual is not None, num_warps=8 if BLOCK_D >= 4096 else 4,
        )  # fmt: skip
    if residual is None:
        return out.view(x.shape)
    return out.view(x.shape), total.view(x.shape)
