"""Grouped GEMM over experts as one Triton kernel (the CUDA path of the routed experts at
prefill and decode; `torch._grouped_mm` elsewhere, see grouped_gemm.py). Same contract as
`grouped_gemm.grouped_mm`.

Each program computes out[rows, cols]^T = w[e][cols] @ x[rows]^T: the weight tile is the MMA's
M side (block_n output columns) and the expert's rows are its N side, where wgmma takes any
multiple of 8 (as M it takes 64 per warpgroup; row tiles under 64 ran on mma.sync before). So
an expert's rows are covered by a tile of block_m rows and a second one of block_t rows, and a
program runs only what its rows need (both, the first, or the second alone). At k3-slice
prefill (~146 rows per expert, 118-173 in the benchmark's draw) 128 + 32 rows compute 160 per
expert, 91% of them useful, where row tiles of 128 (torch's CUTLASS kernel, and this kernel
before, with the rows as M) compute 256, 57% useful. x and w are read through TMA descriptors
(host-side, `triton.tools.tensor_descriptor`; Hopper and later): rows past an expert's end are
read (the next expert's, or zeros past the tensor) and not stored.

Tiles are laid out per expert: expert e owns cdiv(count_e, block_m + block_t) of them,
numbered after those of the experts before it. Each program finds its tile's expert and first
row itself from the group ends (`program_tile`: a scan over the experts' tile counts in
registers); the grid is sized by a bound on the tiles, M // tile + min(E, M), which needs no
host read, and programs past the last real tile exit at once. Program order is expert-major:
an expert's programs run side by side, column block after column block with its row tiles
innermost, so its rows and each [block_n, K] weight tile are read from memory once and then
from L2 (tile-major order streamed all of x again per column block: 32.1 -> 25.7 ms at k3-slice
prefill on one H200).

One H200, k3-slice prefill, the two GEMMs of 7 layers x 8,192 tokens (`k3batch bench moe
--sweep`, rows in `benchmarks/moe_k3slice_h200.jsonl`): 128 + 32 rows x 128 columns x 64
inputs, 8 warps, 3 stages: 17.1-17.9 ms on real activations (54-57% of the bf16 peak; 20.2 on
one machine) against 19.7-21.0 ms for `torch._grouped_mm`. Both run at the board's 700 W
power cap (SM clock ~1,330 and ~1,490 of 1,980 MHz); cuBLAS's batched GEMM on ideal routes
(every expert exactly 146 rows) takes 13.96 ms on the same machine. The tile sweeps (128 + 64
rows 16.9 ms, 128 + 0 20.5-20.8, 4 warps 16.5-16.9 against 15.7-16.6 for the tuned tile) ran
the down GEMM on an unwritten buffer, zeros on those machines, which these GEMMs run 13-16%
faster on.
Before, with the rows as M: 22.5 ms with pointer loads (128-row tiles, each expert's last one
in steps of 64 rows), 20.7 with TMA. The swapped kernel with pointer loads took 19.6 ms. At
decode (64 tokens, ~1 row per expert; block_m 16, block_t 0) it reads the experts' weights at
4.3-4.6 TB/s (7.4-8.0 ms; a read-only stream; the copy bandwidth is 4.26), as the kernel
before did (7.47 ms in the same run as a 7.44).
With `rows_M` (each sorted row's row of an unsorted x [T, K]) the kernel reads x by index,
with pointer loads, so that the routed pass need not gather x into a sorted copy first (one
read and one write of [T k, D] a layer, 4.7 ms of Kimi Linear's 8K prefill on an H200); the
weights still come through TMA. Pointer loads fed the MMA more slowly than TMA before (above),
so a tuned launch takes it only where `bench moe --sweep` timed it faster than the copy plus
the TMA-read GEMM ("gather" in the table, read by `fusions`).
With `act` the gate-up GEMM applies the gated activation to its fp32 sums: each program loads
a tile of gate rows and the matching tile of up rows and stores act(gate, up), so the pass
writes [T k, I] once where it wrote [T k, 2 I], read it back and wrote [T k, I] in `moe_act`
(Kimi Linear's 8K prefill: 0.8 GB a layer; the act kernel alone ran at 96% of the copy
bandwidth, about 0.1 ms a layer). Each program keeps two accumulators of block_n / 2 columns,
so a tile tuned for the unfused GEMM keeps its registers and shared memory. Like the gather, a
tuned choice ("act"): not yet timed on a GPU, so off until a sweep picks it.
Runs under TRITON_INTERPRET=1 on CPU.
Shape legend: M sorted rows, K input width, N output width, E experts, T tokens.
"""

from pathlib import Path

import torch
import triton
import triton.language as tl

from k3kernels import INTERPRETED, tuned
from k3kernels.moe.act import gated


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
def _swapped_loop(xa_desc, xb_desc, w_desc, x_ptr, tok_ptr, stride_x, out_ptr, first, end, w_row,
                  up_rows, cols, col_ok, K, stride_out, beta, linear_beta, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, ROWS_A: tl.constexpr, ROWS_B: tl.constexpr,
                  GATHER: tl.constexpr, ACT: tl.constexpr, UPCAST: tl.constexpr,
                  PTX: tl.constexpr):  # fmt: skip
    """out[r, cols] = x[r] @ w[cols].T for the rows r below end of [first, first + ROWS_A)
    (x through xa_desc, whose box is ROWS_A rows) and of [first + ROWS_A, + ROWS_B) (xb_desc),
    as two accumulators [BLOCK_N, rows] sharing each weight tile; a size 0: no such tile.
    GATHER: row r is x's row tok[r] instead, read with pointer loads (x [T, K] at x_ptr).
    ACT (1 SiTU, 2 SwiGLU; 0 none): out[r, cols] = act(gate, up) instead, gate = x[r] @
    w[cols].T and up = x[r] @ w[cols + up_rows].T, each with accumulators of its own, and the
    activation applied to the fp32 sums (`act.gated`; PTX: its MUFU instructions)."""
    if ROWS_A > 0:
        acc_a = tl.zeros([BLOCK_N, ROWS_A], dtype=tl.float32)
        if ACT > 0:
            up_a = tl.zeros([BLOCK_N, ROWS_A], dtype=tl.float32)
        if GATHER:
            tok_a = _row_tokens(tok_ptr, first, end, ROWS_A)
    if ROWS_B > 0:
        acc_b = tl.zeros([BLOCK_N, ROWS_B], dtype=tl.float32)
        if ACT > 0:
            up_b = tl.zeros([BLOCK_N, ROWS_B], dtype=tl.float32)
        if GATHER:
            tok_b = _row_tokens(tok_ptr, first + ROWS_A, end, ROWS_B)
    for k0 in range(0, K, BLOCK_K):
        w = w_desc.load([w_row, k0])  # [BLOCK_N, BLOCK_K]
        if UPCAST:  # the CPU interpreter multiplies bf16 bit patterns as integers
            w = w.to(tl.float32)
        if ACT > 0:
            wu = w_desc.load([w_row + up_rows, k0])
            if UPCAST:
                wu = wu.to(tl.float32)
        if ROWS_A > 0:
            if GATHER:
                xa = _gather_rows(x_ptr, tok_a, stride_x, k0, K, BLOCK_K)
            else:
                xa = xa_desc.load([first, k0])
            xa = tl.trans(xa.to(tl.float32) if UPCAST else xa)
            acc_a += tl.dot(w, xa)
            if ACT > 0:
                up_a += tl.dot(wu, xa)
        if ROWS_B > 0:
            if GATHER:
                xb = _gather_rows(x_ptr, tok_b, stride_x, k0, K, BLOCK_K)
            else:
                xb = xb_desc.load([first + ROWS_A, k0])
            xb = tl.trans(xb.to(tl.float32) if UPCAST else xb)
            acc_b += tl.dot(w, xb)
            if ACT > 0:
                up_b += tl.dot(wu, xb)
    if ROWS_A > 0:
        if ACT > 0:
            acc_a = gated(acc_a, up_a, beta, linear_beta, ACT == 1, PTX)
        _store_t(out_ptr, acc_a, first, end, cols, col_ok, stride_out, ROWS_A)
    if ROWS_B > 0:
        if ACT > 0:
            acc_b = gated(acc_b, up_b, beta, linear_beta, ACT == 1, PTX)
        _store_t(out_ptr, acc_b, first + ROWS_A, end, cols, col_ok, stride_out, ROWS_B)


@triton.jit
def _row_tokens(tok_ptr, first, end, ROWS: tl.constexpr):
    """x's row of each sorted row [first, first + ROWS) (int64); row 0 past end (read, not
    stored)."""
    rows = first + tl.arange(0, ROWS)
    return tl.load(tok_ptr + rows, mask=rows < end, other=0).to(tl.int64)


@triton.jit
def _gather_rows(x_ptr, tok, stride_x, k0, K, BLOCK_K: tl.constexpr):
    """x[tok, k0 : k0 + BLOCK_K] ([ROWS, BLOCK_K]; zeros past K)."""
    ks = k0 + tl.arange(0, BLOCK_K)
    return tl.load(x_ptr + tok[:, None] * stride_x + ks[None, :], mask=(ks < K)[None, :],
                   other=0.0)  # fmt: skip


@triton.jit
def _store_t(out_ptr, acc, first, end, cols, col_ok, stride_out, ROWS: tl.constexpr):
    """out[rows, cols] = acc.T for the rows [first, first + ROWS) below end."""
    rows = first + tl.arange(0, ROWS)
    o_ptrs = out_ptr + rows.to(tl.int64)[None, :] * stride_out + cols[:, None]
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(rows < end)[None, :] & col_ok[:, None])


@triton.jit
def grouped_gemm_kernel(xa_desc, xb_desc, w_desc, x_ptr, tok_ptr, stride_x, out_ptr, offs_ptr, N,
                        K, stride_out, E, beta, linear_beta, BLOCK_M: tl.constexpr,
                        BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        BLOCK_E: tl.constexpr, GATHER: tl.constexpr, ACT: tl.constexpr,
                        UPCAST: tl.constexpr, PTX: tl.constexpr):  # fmt: skip
    """N: the output's columns; with ACT, w holds 2 N rows an expert (gate rows, then up)."""
    expert, first, n_block = program_tile(offs_ptr, E, N, BLOCK_M + BLOCK_T, BLOCK_N, BLOCK_E)
    if expert < E:
        end = tl.minimum(tl.load(offs_ptr + expert), first + BLOCK_M + BLOCK_T)
        cols = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        w_rows = 2 * N if ACT > 0 else N  # an expert's rows of w
        w_row = expert * w_rows + n_block * BLOCK_N  # in w viewed as [E w_rows, K]
        rows = end - first
        if BLOCK_T > 0 and rows > BLOCK_M:
            _swapped_loop(xa_desc, xb_desc, w_desc, x_ptr, tok_ptr, stride_x, out_ptr, first, end,
                          w_row, N, cols, col_ok, K, stride_out, beta, linear_beta, BLOCK_N,
                          BLOCK_K, BLOCK_M, BLOCK_T, GATHER, ACT, UPCAST, PTX)  # fmt: skip
        elif BLOCK_T == 0 or rows > BLOCK_T:
            _swapped_loop(xa_desc, xb_desc, w_desc, x_ptr, tok_ptr, stride_x, out_ptr, first, end,
                          w_row, N, cols, col_ok, K, stride_out, beta, linear_beta, BLOCK_N,
                          BLOCK_K, BLOCK_M, 0, GATHER, ACT, UPCAST, PTX)  # fmt: skip
        else:
            _swapped_loop(xa_desc, xb_desc, w_desc, x_ptr, tok_ptr, stride_x, out_ptr, first, end,
                          w_row, N, cols, col_ok, K, stride_out, beta, linear_beta, BLOCK_N,
                          BLOCK_K, 0, BLOCK_T, GATHER, ACT, UPCAST, PTX)  # fmt: skip


DEFAULT_CONFIGS = {
    "decode": dict(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=4),
    "prefill": dict(block_m=64, block_t=32, block_n=128, block_k=64, num_warps=4, num_stages=2),
}
# This kernel's and the W4A16 kernel's tuned launches (`k3kernels.tuned`): tables "bf16" and
# "mxfp4", keys "<regime> N=<n> K=<k> rows/expert=<r>" (`table_key`), fallbacks "prefill" and
# "decode" (any shape). On NVIDIA_H200.json those are the launches tuned at k3-slice, under its
# two GEMMs' keys too (N=6144 K=3584 and N=3584 K=3072; 256 rows per expert at prefill, 2 at
# decode: 8,192 and 64 tokens).
TUNED_DIR = Path(__file__).with_name("tuned")


# Decode tiles (16 rows, weights streamed once) up to this many slots per expert on average.
# One H200, k3-slice, 256 tokens (4.6 per expert): MXFP4 8.4 ms with decode tiles against 20.3
# with prefill ones, bf16 12.7 ms (Triton, decode tiles) against 17.0 (torch's grouped GEMM).
DECODE_ROWS_PER_EXPERT = 8


def regime(num_rows: int, num_experts: int) -> str:
    """"decode" (few rows per expert: memory bound) or "prefill"."""
    return "decode" if num_rows <= DECODE_ROWS_PER_EXPERT * num_experts else "prefill"


def table_key(num_rows: int, num_experts: int, n: int, k: int) -> str:
    """The tuned-table key of a grouped GEMM of num_rows sorted rows over num_experts experts,
    n outputs and k inputs: its regime, N and K, and its rows per expert (a power of two, so
    the decode sizes, at most DECODE_ROWS_PER_EXPERT, stay apart from the prefill ones)."""
    shape = f"{regime(num_rows, num_experts)} N={n} K={k}"
    return tuned.make_key(shape, "rows/expert", -(-num_rows // max(num_experts, 1)))


def launch_config(num_rows: int, num_experts: int, weights: str = "bf16",
                  nk: tuple[int, int] | None = None) -> dict:  # fmt: skip
    """Tiles by the mean rows per expert (host integers): decode (a few rows per expert, the
    weights streamed once, memory bound) takes 16-row tiles and long K steps; prefill larger
    tiles. The current GPU's tuned table overrides the defaults: the entry of this GEMM's
    shape, nk = (N, K), at the nearest rows per expert, else the regime's entry
    (`k3kernels.tuned.lookup`). weights: "bf16" or "mxfp4" (the tuned formats), or any other
    name for the defaults (fp32 inputs: a bf16 table's tiles can exceed shared memory at twice
    the bytes). The defaults' block_t is this kernel's: the W4A16 kernel takes one from its
    table only."""
    kind = regime(num_rows, num_experts)
    key = table_key(num_rows, num_experts, *nk) if nk else None
    found = tuned.lookup(tuned.gpu_path(TUNED_DIR), weights, key, fallback=(kind,))
    defaults = dict(DEFAULT_CONFIGS[kind])
    if weights == "mxfp4":
        defaults.pop("block_t", None)
    return defaults | found


def block_e(num_experts: int) -> int:
    """The vector width over which `program_tile` scans the experts."""
    return max(16, triton.next_power_of_2(num_experts))


def tma_ready(t: torch.Tensor) -> bool:
    """Whether a tensor can be read through a TMA descriptor as 2D rows (x [M, K], or w
    [E, N, K] viewed as [E N, K]): unit last stride, row stride a multiple of 16 bytes, 16-byte
    aligned data, experts one after the other."""
    rows_ok = t.dim() == 2 or t.stride(0) == t.shape[1] * t.stride(1)
    return (t.stride(-1) == 1 and rows_ok and t.stride(-2) * t.element_size() % 16 == 0
            and t.data_ptr() % 16 == 0)  # fmt: skip


ACTS = {"situ": 1, "silu": 2}  # the kernel's ACT


def grouped_mm_triton(x: torch.Tensor, w_ENK: torch.Tensor, offs_E: torch.Tensor,
                      rows_M: torch.Tensor | None = None, act: str | None = None,
                      beta: float = 4.0, linear_beta: float = 25.0,
                      **config) -> torch.Tensor:  # fmt: skip
    """out[r] = x[r] @ w[e].T for the rows r of group e; x [M, K], w [E, N, K] (`tma_ready`
    both), offs [E] int32 cumulative group ends. Rows after offs[-1] are left unwritten.
    rows_M ([M] int, the sorted rows' rows of x): out[r] = x[rows[r]] @ w[e].T instead, x
    [T, K] (unit last stride) read by pointer loads in the kernel, no gathered copy made.
    act ("situ" or "silu", with beta and linear_beta as `moe_act`): w holds gate rows [0, N/2)
    and up rows [N/2, N) an expert and out [M, N/2] = act(gate, up), applied to the fp32 sums
    (no [M, N] output, no second pass); each program then computes block_n / 2 output columns
    from two weight tiles of that height, so a launch tuned for the unfused GEMM keeps its
    accumulators' size.
    config: block_m and block_t (an expert's rows in tiles of block_m + block_t rows, each
    program running the two tiles or one; block_t 0: tiles of block_m), block_n, block_k,
    num_warps, num_stages (default `launch_config`; its "gather" and "act" are the caller's
    choice, `fusions`)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    gather = rows_M is not None
    if not (tma_ready(w_ENK) and (x.stride(-1) == 1 if gather else tma_ready(x))):
        raise ValueError("grouped_mm_triton reads w (and x, unless its rows are gathered) "
                         "through TMA: they need unit last strides, row strides of a multiple "
                         "of 16 bytes, 16-byte aligned data and w's experts one after the "
                         "other")  # fmt: skip
    if act is not None and (act not in ACTS or w_ENK.shape[1] % 2):
        raise ValueError(f"grouped_mm_triton's act is one of {', '.join(ACTS)} over an even "
                         f"number of weight rows (gate, then up); got {act!r} and "
                         f"{w_ENK.shape[1]} rows")  # fmt: skip
    M, K = (rows_M.shape[0], x.shape[1]) if gather else x.shape
    E, N, _ = w_ENK.shape
    cfg = launch_config(M, E, _table(x.dtype), nk=(N, K)) | config
    block_m, block_n, block_k = cfg["block_m"], cfg["block_n"], cfg["block_k"]
    block_t = cfg.get("block_t", 0)
    if act is not None:  # the output's columns, each program's from two tiles of block_n rows
        N, block_n = N // 2, block_n // 2
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    w_desc = TensorDescriptor.from_tensor(w_ENK.view(-1, K), [block_n, block_k])
    if gather:  # the descriptors' places hold w's, unread
        xa_desc = xb_desc = w_desc
    else:
        xa_desc = TensorDescriptor.from_tensor(x, [block_m, block_k])
        xb_desc = TensorDescriptor.from_tensor(x, [block_t, block_k]) if block_t else xa_desc
    grid = (num_tile_slots(M, E, block_m + block_t) * triton.cdiv(N, block_n),)
    grouped_gemm_kernel[grid](xa_desc, xb_desc, w_desc, x, rows_M if gather else offs_E,
                              x.stride(0), out, offs_E, N, K, out.stride(0), E, float(beta),
                              float(linear_beta), BLOCK_M=block_m, BLOCK_T=block_t,
                              BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_E=block_e(E),
                              GATHER=gather, ACT=ACTS.get(act, 0),
                              UPCAST=INTERPRETED and x.dtype != torch.float32,
                              PTX=not INTERPRETED, num_warps=cfg["num_warps"],
                              num_stages=cfg["num_stages"])  # fmt: skip
    return out


def fusions(num_rows: int, num_experts: int, n: int, k: int, dtype: torch.dtype,
            packed: bool = False) -> dict:  # fmt: skip
    """What the tuned launch of the gate-up GEMM (num_rows sorted rows of dtype over
    num_experts experts, n outputs, k inputs; packed: the W4A16 kernel's, table "mxfp4") folds
    in: {"gather": it reads its rows of x by index (`rows_M`) rather than from a gathered copy,
    "act": it applies the gated activation (`act`) rather than leaving it to `moe_act`}. Each
    is the table's, chosen by `bench moe --sweep` against the separate pass. Where no entry
    says: the gather on for the W4A16 kernel (it loads x by pointers anyway) and off for this
    one (TMA reads x faster), the activation off; both off for a dtype with no table."""
    table = "mxfp4" if packed else _table(dtype)
    cfg = launch_config(num_rows, num_experts, table, nk=(n, k))
    return {"gather": bool(cfg.get("gather", packed)), "act": bool(cfg.get("act", False))}


def _table(dtype: torch.dtype) -> str:
    """The tuned table of a GEMM of rows of dtype: "bf16", or a name no table has."""
    return "bf16" if dtype == torch.bfloat16 else str(dtype)
