"""The column order in which the Gluon W4A16 decode kernel (`w4a16_decode`) reads its rows.

Within each 256-column step, the 16-byte chunk i (columns 8 i .. 8 i + 7) of quarter q (64
columns) sits at chunk position 4 i + q: column 256 s + 64 q + 8 i + e is stored at 256 s + 32 i
+ 8 q + e. A row's 4 threads of one quarter each then read 64 contiguous bytes per load (in the
natural order, each load touched 32 cache lines and the kernel was bound by L1). The producers
write this order directly so that no copy runs between them and the GEMM: `gather_interleaved`
(the routed slots' rows of x, for the gate-up GEMM) and `moe_act(..., interleave=True)` (the
activation, for the down GEMM). Runs under TRITON_INTERPRET=1 on CPU.
Shape legend: T rows of x, M gathered rows, K columns.
"""

import torch
import triton
import triton.language as tl

from k3kernels.pdl import launch_options, wait_then_signal

STEP = 256  # columns per interleaving step (the decode kernel's K step)
BLOCK_K = 1024  # columns per program of `gather_interleaved`


@triton.jit
def interleaved_column(col):
    """Where column col is stored in the interleaved order (see the module doc)."""
    return (col & ~255) | (((col >> 3) & 7) << 5) | (((col >> 6) & 3) << 3) | (col & 7)


@triton.jit
def _gather_kernel(x_ptr, rows_ptr, out_ptr, K, stride_x, stride_out, HAS_ROWS: tl.constexpr,
                   BLOCK_K: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    wait_then_signal(PDL)
    m = tl.program_id(0)
    src = tl.load(rows_ptr + m).to(tl.int64) if HAS_ROWS else m.to(tl.int64)
    col = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = col < K
    v = tl.load(x_ptr + src * stride_x + col, mask=mask)
    tl.store(out_ptr + m.to(tl.int64) * stride_out + interleaved_column(col), v, mask=mask)


def gather_interleaved(x_TK: torch.Tensor, rows_M: torch.Tensor | None = None) -> torch.Tensor:
    """x[rows] (all of x's rows without rows) as [M, K] in the interleaved column order; K a
    multiple of 256, x with unit column stride."""
    T, K = x_TK.shape
    if K % STEP or x_TK.stride(-1) != 1:
        raise ValueError(f"gather_interleaved needs rows of a multiple of {STEP} contiguous "
                         f"columns, got {tuple(x_TK.shape)} strides {x_TK.stride()}")  # fmt: skip
    M = T if rows_M is None else rows_M.numel()
    out = torch.empty(M, K, dtype=x_TK.dtype, device=x_TK.device)
    if M:
        grid = (M, triton.cdiv(K, BLOCK_K))
        _gather_kernel[grid](x_TK, x_TK if rows_M is None else rows_M, out, K, x_TK.stride(0),
                             out.stride(0), HAS_ROWS=rows_M is not None, BLOCK_K=BLOCK_K,
                             num_warps=4, **launch_options(x_TK.device))  # fmt: skip
    return out


def interleave_reference(x_MK: torch.Tensor) -> torch.Tensor:
    """The interleaved order by torch views (the oracle of the kernels that write it)."""
    M, K = x_MK.shape
    v = x_MK.reshape(M, K // STEP, 4, 8, 8)  # step, quarter, chunk, element
    return v.transpose(2, 3).reshape(M, K)
