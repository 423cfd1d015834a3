"""Grouped GEMM over experts as one Triton kernel with small row tiles (an alternative to
`torch._grouped_mm`, whose 128-row tiles waste 43% of the rows on K3-slice prefill groups of
~146 rows, and nearly all of them on decode groups of 1-2 rows; see grouped_gemm.py). Same
contract as `grouped_gemm.grouped_mm`.

The M tiles are laid out per expert: expert e owns cdiv(count_e, block_m) tiles, numbered after
those of the experts before it. Each program finds its tile's expert and first row itself from
the group ends (`program_tile`: a scan over the experts' tile counts in registers); the grid is
sized by a bound on the tiles, M // block_m + min(E, M), which needs no host read, and programs
past the last real tile exit at once. (The table this replaced took ~15 small torch kernels per
call: ~45 us of GPU time, more than the GEMM itself at one token.) Program order
(`program_tile`) is expert-major: an expert's programs run side by side, N block after N block
with its M tiles innermost, so both its rows of x and each [block_n, K] tile of its weight are
read from memory once and then from L2. (In tile-major order, every N block streamed all of x
again: at k3-slice prefill, 117 MB of rows 48 times per gate-up GEMM, about as many bytes as
the weights themselves. On one H200 at k3-slice prefill the expert-major order took the GEMMs
from 32.1 to 25.7 ms at the same tiles.) Each program computes a [block_m, block_n] tile of
x[rows] @ w[e].T with fp32 accumulation (`tl.dot`; TF32 for fp32 inputs unless
TRITON_F32_DEFAULT says otherwise). Runs under TRITON_INTERPRET=1 on CPU.
Measured on one H200 at k3-slice prefill (`k3batch bench moe --sweep`, 7 layers x 8,192 tokens):
~146 rows per expert fill one 128-row tile and 18/128 of a second, so 57% of the computed rows
are useful. `block_t` runs each expert's last, partial tile in steps of block_t rows instead
(the same program, its weight tile then read from L2). 128 x 256 x 64 tiles, 8 warps: 24.1 ms
(40% of the bf16 peak) plain, 22.5 ms (43%) with block_t = 64 (76% of the rows useful), 26.3 ms
with block_t = 32 (91% useful, but tiles under 64 rows run on mma.sync, not wgmma); torch's
grouped GEMM takes 20.5 ms (48%) with its 128-row tiles, so it serves prefill. Per computed row
this kernel's main tiles run at ~71% of the peak against ~83% for torch's CUTLASS one. Loading
x and w through TMA descriptors instead (a trial, 2026-12-02, rows in
`benchmarks/moe_k3slice_h200.jsonl`) took the same tiles with 64-row tail steps and 4 stages to
20.7 ms, level with torch's 20.7 in that run, not past it; Triton's warp-specialized loop was
slower (24.1 ms). At decode shapes the Triton kernel streams the weights at 3.9-4.0 TB/s
against 2.8-3.0 for torch.
Shape legend: M sorted rows, K input width, N output width, E experts.
"""

import functools
import json
import os
from pathlib import Path

import torch
import triton
import triton.language as tl

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # read at import, like triton.jit


def num_tile_slots(num_rows: int, num_experts: int, BLOCK_M: int) -> int:
    """A bound on the row tiles of any grouping of num_rows rows over num_experts experts (host
    integers, no device read): sum_e cdiv(c_e, BLOCK_M) <= M // BLOCK_M + (experts with a row)."""
    return num_rows // BLOCK_M + min(num_experts, num_rows)


@triton.jit
def program_tile(offs_ptr, E, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_E: tl.constexpr):  # fmt: skip
    """(expert, first row, N block) of this program (1D grid of `num_tile_slots` x
    cdiv(N, BLOCK_N)), in the expert-major order of the module doc; expert E for a program past
    the last real tile. Every program reads the E group ends and scans the experts' tile counts
    itself (E <= BLOCK_E), so no table is built before the launch."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    t = pid // num_n  # expert e's programs are [first tile of e, its last + 1) x num_n
    ee = tl.arange(0, BLOCK_E)
    ends = tl.load(offs_ptr + ee, mask=ee < E, other=0)
    starts = tl.load(offs_ptr + ee - 1, mask=(ee > 0) & (ee < E), other=0)
    tiles = tl.where(ee < E, (ends - starts + BLOCK_M - 1) // BLOCK_M, 0)
    tile_ends = tl.cumsum(tiles, 0)
    expert = tl.sum((tile_ends <= t).to(tl.int32), 0)  # E past the last tile
    mine = ee == expert
    group_size = tl.sum(tl.where(mine, tiles, 0), 0)
    group_start = tl.sum(tl.where(mine, tile_ends, 0), 0) - group_size
    local = pid - group_start * num_n
    size = tl.maximum(group_size, 1)
    first = tl.sum(tl.where(mine, starts, 0), 0) + (local % size) * BLOCK_M
    return expert, first, local // size


@triton.jit
def tile_rows_cols(first, offs_ptr, expert, n_block, N, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr):  # fmt: skip
    """(rows, cols, row_ok, col_ok) of this program's output tile."""
    end = tl.load(offs_ptr + expert)
    rows = first + tl.arange(0, BLOCK_M)
    cols = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    return rows, cols, rows < end, cols < N


@triton.jit
def _gemm_tile(x_ptr, w_base, out_ptr, first, end, cols, col_ok, K, stride_x, stride_wn,
               stride_out, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               UPCAST: tl.constexpr):  # fmt: skip
    """out[rows] = x[rows] @ w.T over columns `cols` for rows [first, min(first + BLOCK_M, end))."""
    rows = first + tl.arange(0, BLOCK_M)
    row_ok = rows < end
    kk = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_x + kk[None, :]
    b_ptrs = w_base + cols.to(tl.int64)[None, :] * stride_wn + kk[:, None]  # [BK, BN]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + kk) < K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if UPCAST:  # the CPU interpreter multiplies bf16 bit patterns as integers
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc += tl.dot(a, b)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    o_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_out + cols[None, :]
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def grouped_gemm_kernel(x_ptr, w_ptr, out_ptr, offs_ptr, N, K, stride_x, stride_we, stride_wn,
                        stride_out, E, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_T: tl.constexpr,
                        UPCAST: tl.constexpr):  # fmt: skip
    expert, first, n_block = program_tile(offs_ptr, E, N, BLOCK_M, BLOCK_N, BLOCK_E)
    if expert < E:
        end = tl.load(offs_ptr + expert)
        cols = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        w_base = w_ptr + expert.to(tl.int64) * stride_we
        if BLOCK_T > 0 and end - first < BLOCK_M:  # an expert's last, partial tile
            for t0 in range(first, end, BLOCK_T):
                _gemm_tile(x_ptr, w_base, out_ptr, t0, end, cols, col_ok, K, stride_x,
                           stride_wn, stride_out, BLOCK_T, BLOCK_N, BLOCK_K, UPCAST)  # fmt: skip
        else:
            _gemm_tile(x_ptr, w_base, out_ptr, first, end, cols, col_ok, K, stride_x,
                       stride_wn, stride_out, BLOCK_M, BLOCK_N, BLOCK_K, UPCAST)  # fmt: skip


DEFAULT_CONFIGS = {
    "decode": dict(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=4),
    "prefill": dict(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=3),
}
TUNED_DIR = Path(__file__).with_name("tuned")  # one JSON per GPU name: {weights: {regime: cfg}}


@functools.cache
def tuned_configs(device_name: str) -> dict:
    """The tuned table of a GPU (`tuned/<name>.json`, spaces as underscores), or {}."""
    path = TUNED_DIR / (device_name.replace(" ", "_") + ".json")
    return json.loads(path.read_text()) if path.exists() else {}


# Decode tiles (16 rows, weights streamed once) up to this many slots per expert on average.
# One H200, k3-slice, 256 tokens (4.6 per expert): MXFP4 8.4 ms with decode tiles against 20.3
# with prefill ones, bf16 12.7 ms (Triton, decode tiles) against 17.0 (torch's grouped GEMM).
DECODE_ROWS_PER_EXPERT = 8


def regime(num_rows: int, num_experts: int) -> str:
    """"decode" (few rows per expert: memory bound) or "prefill"."""
    return "decode" if num_rows <= DECODE_ROWS_PER_EXPERT * num_experts else "prefill"


def launch_config(num_rows: int, num_experts: int, weights: str = "bf16") -> dict:
    """Tiles by the mean rows per expert (host integers): decode (a few rows per expert, the
    weights streamed once, memory bound) takes 16-row tiles and long K steps; prefill larger
    tiles. The current GPU's tuned table (`k3batch bench moe --sweep` measures one) overrides
    the defaults; weights: "bf16" or "mxfp4" (the tuned formats), or any other name for the
    defaults (fp32 inputs: a bf16 table's tiles can exceed shared memory at twice the bytes)."""
    kind = regime(num_rows, num_experts)
    tuned = {}
    if not _INTERPRETED and torch.cuda.is_available():
        tuned = tuned_configs(torch.cuda.get_device_name()).get(weights, {}).get(kind, {})
    return DEFAULT_CONFIGS[kind] | tuned


def block_e(num_experts: int) -> int:
    """The vector width over which `program_tile` scans the experts."""
    return max(16, triton.next_power_of_2(num_experts))


def grouped_mm_triton(x_MK: torch.Tensor, w_ENK: torch.Tensor, offs_E: torch.Tensor,
                      **config) -> torch.Tensor:  # fmt: skip
    """out[r] = x[r] @ w[e].T for the rows r of group e; x [M, K], w [E, N, K] with unit last
    strides, offs [E] int32 cumulative group ends. Rows after offs[-1] are left unwritten.
    config: block_m, block_n, block_k, num_warps, num_stages (default `launch_config`), and
    block_t: rows per step of each expert's last, partial tile (0: one block_m tile)."""
    if x_MK.stride(-1) != 1 or w_ENK.stride(-1) != 1:
        raise ValueError("grouped_mm_triton needs unit last strides on x and w")
    M, K = x_MK.shape
    E, N, _ = w_ENK.shape
    weights = "bf16" if x_MK.dtype == torch.bfloat16 else str(x_MK.dtype)
    cfg = launch_config(M, E, weights) | config
    block_m, block_n = cfg["block_m"], cfg["block_n"]
    out = torch.empty(M, N, dtype=x_MK.dtype, device=x_MK.device)
    if M == 0:
        return out
    grid = (num_tile_slots(M, E, block_m) * triton.cdiv(N, block_n),)
    grouped_gemm_kernel[grid](x_MK, w_ENK, out, offs_E, N, K, x_MK.stride(0), w_ENK.stride(0),
                              w_ENK.stride(1), out.stride(0), E, BLOCK_M=block_m,
                              BLOCK_N=block_n, BLOCK_K=cfg["block_k"], BLOCK_E=block_e(E),
                              BLOCK_T=cfg.get("block_t", 0),
                              UPCAST=_INTERPRETED and x_MK.dtype != torch.float32,
                              num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])  # fmt: skip
    return out
