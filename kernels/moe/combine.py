"""Weighted combine of the experts' rows per token, accumulated in fp32, no atomics.

out[t] = sum_{j < k} valid[t, j] * weights[t, j] * y[slot_pos[t, j]]: each program owns one
token and a BLOCK_D slice of its row and adds the k terms in slot order, so the result does not
depend on scheduling (deterministic for a given batch). Invalid slots (another rank's experts)
are masked out, never multiplied: their rows of y are unwritten memory.
With out_dtype (and adds), the same program also casts the sum and adds up to two tensors of
that dtype in order (Kimi Linear's shared-expert output, then the layer's residual stream),
rounding as torch's `(sum.to(dtype) + a0) + a1` does: one pass over [T, D] where the cast and
the adds were three kernels and three more passes (78 launches a Kimi Linear decode step).
Oracle: `reference.combine_reference`. Runs under TRITON_INTERPRET=1 on CPU.
Shape legend: T tokens, k top-k, M = T k sorted rows, D width.
"""

import torch
import triton
import triton.language as tl

from k3kernels.pdl import launch_options, wait_then_signal


@triton.jit
def moe_combine_kernel(y_ptr, pos_ptr, w_ptr, valid_ptr, add0_ptr, add1_ptr, out_ptr, stride_y,
                       stride_part, stride_add0, stride_add1, D, TOP_K: tl.constexpr,
                       PARTS: tl.constexpr, ADDS: tl.constexpr, BLOCK_D: tl.constexpr,
                       PDL: tl.constexpr):  # fmt: skip
    wait_then_signal(PDL)
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = d < D
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        # The flag is loaded as a vector: a scalar mask is refused by the interpreter.
        ok = tl.load(valid_ptr + t * TOP_K + j + d * 0) != 0
        pos = tl.load(pos_ptr + t * TOP_K + j)
        w = tl.load(w_ptr + t * TOP_K + j).to(tl.float32)
        y = tl.load(y_ptr + pos * stride_y + d, mask=dmask & ok, other=0.0).to(tl.float32)
        for p in tl.static_range(1, PARTS):  # partial products of a split K, summed in order
            y += tl.load(y_ptr + p * stride_part + pos * stride_y + d, mask=dmask & ok, other=0.0)
        acc += tl.where(ok, w, 0.0) * y
    out = acc.to(out_ptr.dtype.element_ty)
    # each add: in fp32 onto the value rounded to the output dtype, then rounded again
    if ADDS >= 1:
        a = tl.load(add0_ptr + t * stride_add0 + d, mask=dmask, other=0.0).to(tl.float32)
        out = (out.to(tl.float32) + a).to(out_ptr.dtype.element_ty)
    if ADDS >= 2:
        a = tl.load(add1_ptr + t * stride_add1 + d, mask=dmask, other=0.0).to(tl.float32)
        out = (out.to(tl.float32) + a).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + t * D + d, out, mask=dmask)


def moe_combine(y_MD, slot_pos_Tk, weights_Tk, valid_Tk, *, out_dtype=torch.float32,
                adds=()) -> torch.Tensor:  # fmt: skip
    """[T, D] in out_dtype (default fp32) from y [M, D], or the sum of K's partial products
    [parts, M, D] (`w4a16_decode`), unit column stride; slot_pos [T, k] int64, weights [T, k],
    valid [T, k] bool. adds: up to two [T, D] tensors of out_dtype (unit column stride) added
    in order to the rounded sum, each sum rounded."""
    T, k = slot_pos_Tk.shape
    D = y_MD.shape[-1]
    parts, stride_part = (y_MD.shape[0], y_MD.stride(0)) if y_MD.dim() == 3 else (1, 0)
    out = torch.empty(T, D, dtype=out_dtype, device=y_MD.device)
    if len(adds) > 2:
        raise ValueError(f"{len(adds)} tensors to add: the combine adds at most 2")
    for a in adds:
        if a.shape != out.shape or a.dtype != out_dtype or a.stride(-1) != 1:
            raise ValueError(f"an add of {list(a.shape)} {a.dtype}: expected [{T}, {D}] "
                             f"{out_dtype} with unit column stride")  # fmt: skip
    if T == 0:
        return out
    BLOCK_D = min(1024, triton.next_power_of_2(D))
    grid = (T, triton.cdiv(D, BLOCK_D))
    a0, a1 = (list(adds) + [out, out])[:2]  # unused pointers: any tensor
    moe_combine_kernel[grid](y_MD, slot_pos_Tk.contiguous(), weights_Tk.float().contiguous(),
                             valid_Tk.contiguous().view(torch.uint8), a0, a1, out,
                             y_MD.stride(-2), stride_part, a0.stride(0), a1.stride(0), D,
                             TOP_K=k, PARTS=parts, ADDS=len(adds), BLOCK_D=BLOCK_D,
                             **launch_options(out.device))  # fmt: skip
    return out
