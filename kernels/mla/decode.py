"""Paged MLA decode (absorbed form) straight over the latent pages, split over the sequence.

Stage 1 (`mla_decode_kernel`): program (head block, split, sequence) walks its split's tokens
through the page table, BLOCK_N tokens at a time: score = q_lat . c + q_rope . k_rope (the
cached [c | k_rope] row read once for BLOCK_H heads), an fp32 online softmax, acc += p c.
It writes its partial (normalized over the split) and its log-sum-exp. Stage 2 is the LSE merge
of `merge.py` over the splits; with one split stage 1 writes the output directly. The LSE is
returned, so DCP ranks merge their partials with the same code.
The head block is the fastest-varying program id: the programs that read one split's latent
rows run side by side and share them through L2.
With two warpgroups (SPLIT_SCORES, the many-head launch) each computes the scores of half the
tile's tokens and both then use all of p for their half of the latent: see `_split_scores_loop`.

Shape legend: B sequences, H heads, L latent (kv_lora), R rope dims, C = L + R, P pages,
N tokens per page, M splits.
"""

from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from k3kernels import tuned
from k3kernels.mla.merge import merge_lse


@triton.jit
def _tile(n0, start, end, b, pool_ptr, rows_ptr, stride_pp, stride_pt, stride_rb,
          PAGE: tl.constexpr, BLOCK_N: tl.constexpr, ANY_N0: tl.constexpr):  # fmt: skip
    """(cached row pointers [BLOCK_N], ok [BLOCK_N]) of the tokens at positions n0.., ok where
    start <= position < end; n0 in [start, end) unless ANY_N0."""
    pos = n0 + tl.arange(0, BLOCK_N)
    ok = (pos >= start) & (pos < end) if ANY_N0 else pos < end
    if PAGE % BLOCK_N == 0:  # the tile lies in one page: one page row, a scalar
        row_ptr = rows_ptr + b * stride_rb + n0 // PAGE
        if ANY_N0:
            page_row = tl.load(row_ptr, mask=(n0 >= start) & (n0 < end), other=0)
        else:
            page_row = tl.load(row_ptr)
        tok = (pool_ptr + page_row.to(tl.int64) * stride_pp
               + (n0 % PAGE + tl.arange(0, BLOCK_N)) * stride_pt)  # fmt: skip
    else:
        page_row = tl.load(rows_ptr + b * stride_rb + pos // PAGE, mask=ok, other=0)
        tok = pool_ptr + page_row.to(tl.int64) * stride_pp + (pos % PAGE) * stride_pt
    return tok, ok


@triton.jit
def _split_scores_loop(q_lat, q_rope, m, denom, acc, offs_l, l_ok, offs_r, r_ok, start, end, b,
                       pool_ptr, rows_ptr, stride_pp, stride_pt, stride_rb, qk_scale,
                       L: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                       PRECISION: tl.constexpr):  # fmt: skip
    """The token loop for two warpgroups (8 warps) over BLOCK_H = 64 heads: each computes the
    scores of half the tile's tokens, and p goes to both through shared memory, so the scores
    are computed once. Triton (3.6 to 3.9) gives a dot whose result reaches another dot all its
    warps along M (`warpsPerTileV3`, for softmax rows within a warp), and 8 warps over 64 rows
    then compute every score twice, 1.53x the useful MMA work. Its check follows uses, not
    values carried by a loop or yielded by an `if`, so here no use of a score dot's result
    leads to a dot: the softmax sits in an `if` (whose condition is real: the loop starts one
    tile early, a tile of no tokens), and the rope part of the scores, the latent dot's
    accumulator, is computed one tile ahead and carried by the loop. Each use of a dot's
    result first appears outside the `if` (the row max): Triton 3.6's pipeliner fails when a
    dot result is first used inside one. One H200, 96 heads x 64 x 8K, 64-token pages: 0.456
    against 0.555 ms in one A/B run (`benchmarks/kernels_h200.txt`)."""
    s_rope = tl.zeros([q_lat.shape[0], BLOCK_N], dtype=tl.float32)
    for n0 in range(start - BLOCK_N, end, BLOCK_N):
        tok, ok = _tile(n0, start, end, b, pool_ptr, rows_ptr, stride_pp, stride_pt, stride_rb,
                        PAGE, BLOCK_N, True)  # fmt: skip
        c = tl.load(tok[:, None] + offs_l[None, :], mask=ok[:, None] & l_ok[None, :], other=0.0)
        s = tl.dot(q_lat, tl.trans(c), s_rope, input_precision=PRECISION)
        s = tl.where(ok[None, :], s * qk_scale, -float("inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        if n0 >= start:
            alpha = tl.exp2(m - m_new)
            p32 = tl.exp2(s - m_new[:, None])
            denom = denom * alpha + tl.sum(p32, axis=1)
            p = p32.to(c.dtype)
        else:  # the tile before the split: no tokens (a computed zero p: a constant tile would
            # take its own shared memory)
            alpha = tl.zeros_like(m)
            p = tl.where(ok[None, :], s, 0.0).to(c.dtype)
        acc = acc * alpha[:, None]
        acc = tl.dot(p, c, acc, input_precision=PRECISION)
        m = m_new
        s_rope = _rope_scores(q_rope, offs_r, r_ok, n0 + BLOCK_N, start, end, b, pool_ptr,
                              rows_ptr, stride_pp, stride_pt, stride_rb, L, PAGE, BLOCK_N,
                              PRECISION)  # fmt: skip
    return m, denom, acc


@triton.jit
def _rope_scores(q_rope, offs_r, r_ok, n0, start, end, b, pool_ptr, rows_ptr, stride_pp,
                 stride_pt, stride_rb, L: tl.constexpr, PAGE: tl.constexpr,
                 BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    """q_rope . k_rope [BLOCK_H, BLOCK_N] of the tile at positions n0.. (0 past the split)."""
    tok, ok = _tile(n0, start, end, b, pool_ptr, rows_ptr, stride_pp, stride_pt, stride_rb,
                    PAGE, BLOCK_N, True)  # fmt: skip
    k_rope = tl.load(tok[:, None] + L + offs_r[None, :], mask=ok[:, None] & r_ok[None, :],
                     other=0.0)  # fmt: skip
    return tl.dot(q_rope, tl.trans(k_rope), input_precision=PRECISION)


@triton.jit
def mla_decode_kernel(
    q_ptr,  # [B, H, C]
    pool_ptr,  # [P, N, C], last dim contiguous
    rows_ptr,  # [B, max pages] int
    lens_ptr,  # [B] int: tokens to attend
    part_ptr,  # [M, B, H, L]
    lse_ptr,  # [M, B, H]
    H,
    qk_scale,  # scale * log2(e)
    stride_qb,
    stride_qh,
    stride_pp,
    stride_pt,
    stride_rb,
    stride_om,
    stride_ob,
    stride_oh,
    stride_lm,
    stride_lb,
    L: tl.constexpr,
    R: tl.constexpr,
    PAGE: tl.constexpr,  # tokens per page: a constant, so // and % are cheap
    NUM_SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (exact products), else "tf32" (unused)
    SPLIT_SCORES: tl.constexpr,  # two warpgroups: `_split_scores_loop`
):
    hb = tl.program_id(0)
    split = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = heads < H
    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    l_ok = offs_l < L if BLOCK_L != L else tl.full([BLOCK_L], 1, tl.int1)
    r_ok = offs_r < R if BLOCK_R != R else tl.full([BLOCK_R], 1, tl.int1)

    q_base = q_ptr + b * stride_qb + heads[:, None] * stride_qh
    q_lat = tl.load(q_base + offs_l[None, :], mask=h_ok[:, None] & l_ok[None, :], other=0.0)
    q_rope = tl.load(q_base + L + offs_r[None, :], mask=h_ok[:, None] & r_ok[None, :], other=0.0)

    seq_len = tl.load(lens_ptr + b)
    per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)

    m = tl.full([BLOCK_H], -float("inf"), dtype=tl.float32)
    denom = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_L], dtype=tl.float32)
    if SPLIT_SCORES:
        m, denom, acc = _split_scores_loop(
            q_lat, q_rope, m, denom, acc, offs_l, l_ok, offs_r, r_ok, start, end, b, pool_ptr,
            rows_ptr, stride_pp, stride_pt, stride_rb, qk_scale, L, PAGE, BLOCK_N, PRECISION
        )
    else:
        for n0 in range(start, end, BLOCK_N):
            tok, ok = _tile(n0, start, end, b, pool_ptr, rows_ptr, stride_pp, stride_pt,
                            stride_rb, PAGE, BLOCK_N, False)  # fmt: skip
            c = tl.load(tok[:, None] + offs_l[None, :], mask=ok[:, None] & l_ok[None, :],
                        other=0.0)  # fmt: skip
            k_rope = tl.load(
                tok[:, None] + L + offs_r[None, :], mask=ok[:, None] & r_ok[None, :], other=0.0
            )
            s = tl.dot(q_lat, tl.trans(c), input_precision=PRECISION) + tl.dot(
                q_rope, tl.trans(k_rope), input_precision=PRECISION
            )  # [BLOCK_H, BLOCK_N]
            s = tl.where(ok[None, :], s * qk_scale, -float("inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(s - m_new[:, None])
            denom = denom * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c, input_precision=PRECISION)
            m = m_new

    empty = denom == 0.0
    out = acc / tl.where(empty, 1.0, denom)[:, None]
    lse = (m + tl.log2(tl.where(empty, 1.0, denom))) * 0.6931471805599453  # natural log
    lse = tl.where(empty, -float("inf"), lse)
    o_ptr = part_ptr + split * stride_om + b * stride_ob + heads[:, None] * stride_oh
    o_mask = h_ok[:, None] & l_ok[None, :]
    tl.store(o_ptr + offs_l[None, :], out.to(part_ptr.dtype.element_ty), mask=o_mask)
    tl.store(lse_ptr + split * stride_lm + b * stride_lb + heads, lse, mask=h_ok)


# Launch settings, measured on one H200 (torch 2.11, triton 3.6) at batch 64 x 8K, 64-token
# pages (`k3batch bench mla-decode [--heads 12] --sweep`). Each program once computed the page
# row of every token of its tile, in the tile's load layout: a page-table load and 64-bit
# address arithmetic per 16-byte vector of latent (SASS compiled for sm_90 on the CPU machine,
# `tests/kernels/sm90.py`: 765 instructions per 32-token block at 16 heads, 18 of them page
# loads; 207 registers). When the tile lies in one page (the page size a multiple of
# BLOCK_N), one scalar page row and a fixed offset tile do it: 650 instructions, 154
# registers. Loading each page's row once for tiles that span pages (16-token pages) measured
# 2x slower (a layout conversion per tile), so such tiles keep the per-token rows.
# - TP / DCP ranks (<= SMALL_HEADS heads; K3 at TP8: 12): 16 heads, 64 tokens, 4 warps, 2
#   stages, 4 splits: 0.157 ms as CUDA-graph replays, 3.84 TB/s on the latent bytes, 90% of the
#   copy bandwidth (0.290 ms before). In the sweep (eager, ~20 us of launches included): 0.165
#   ms; with per-token page rows 0.205 ms; 32-token tiles 0.168 ms at 8 splits. Memory bound
#   (16 x 1,088 x 2 FLOP per 1,152-byte token); the splits fill whole waves (5 splits: 0.19-0.20
#   ms). The 96-head and 16-token-page figures below are the eager sweep's.
# - 96 heads (one GPU, no TP): 64 heads, 64 tokens, 8 warps, 2 stages, 3 splits. At 96 heads
#   the step is at the H200's ridge point (~180 FLOP per latent byte): the tensor cores, not the
#   bandwidth, bound it. Before `_split_scores_loop`, Triton computed every score twice (each of
#   the two warpgroups issued 72 HGMMA.64x32x16 per 64-token block for the whole [64, 64] score
#   tile over C = 576, then 4 HGMMA.64x256x16 for its half of the latent: 1.53x the useful MMA
#   work, 2.04x with the 96 heads padded to 128): 0.549 ms as CUDA-graph replays, 25.8% of copy
#   (0.547 eager; 3 stages 0.679; per-token page rows at best 0.627). With it, 36 + 4 HGMMA per
#   warpgroup (1.33x with the padding): 0.455 ms, 31% of copy, 240 TFLOP/s of useful work (the
#   SASS loop 1,186 -> 749 instructions per block, 216 -> 224 KiB of shared memory: the p tile
#   both warpgroups read). 80% of copy needs 618 TFLOP/s of useful work, 824 with the padding,
#   above the 777 that a bf16 GEMM reaches here. Not kept: the transpose (scores^T = c q^T,
#   acc^T += c^T p^T: tokens, then the latent, as the MMAs' M) computes each score once without
#   the padding but measured 0.80 ms at best over 30 launch settings (its 64-head, 4-warp tile
#   spills the [512, 64] fp32 accumulator; 128-token tiles overflow shared memory); rescaling
#   the accumulator lazily (only when a row's max grows by 2^8) was slower too (0.83 against
#   0.72 ms then): the block-uniform branch broke the overlap of the two MMAs.
# - 16-token pages (the engine's default; tiles span pages, per-token rows): 12 heads 0.208 ms
#   with 32-token tiles (64: 0.282); 96 heads 0.607 ms (0.643 before `_split_scores_loop`, with 3
#   stages; 2 stages were 0.711 then).
# The tuned table (`k3kernels.tuned`: table "decode" of tuned/<GPU>.json, keys `table_key`,
# written by `k3batch bench mla-decode --sweep --save-tuned`) overrides these rules at its shapes.
# FALLBACK fits where a default launch does not (out of shared memory: fp32 inputs).
SMALL_HEADS = 16  # at most this many heads: one head block, memory bound
FALLBACK = dict(block_h=SMALL_HEADS, block_n=32, num_warps=4, num_stages=2)
TUNED_DIR = Path(__file__).with_name("tuned")


def default_config(num_heads: int, page_size: int = 64) -> dict:
    """{block_h, block_n, num_warps, num_stages} by rule, for num_heads query heads per
    sequence over pages of page_size tokens (the measurements above)."""
    one_page = page_size % 64 == 0  # 64-token tiles each within one page
    if num_heads <= SMALL_HEADS:  # TP / DCP ranks
        return dict(block_h=SMALL_HEADS, block_n=64 if one_page else 32, num_warps=4,
                    num_stages=2)
    return dict(block_h=64, block_n=64, num_warps=8, num_stages=2)


def table_key(num_seqs: int, num_heads: int, kv_lora: int, rope: int, page_size: int) -> str:
    """The tuned-table key of a decode step of num_seqs sequences: heads, latent and rope
    widths, page size; the batch as its size."""
    shape = f"H={num_heads} L={kv_lora} R={rope} page={page_size}"
    return tuned.make_key(shape, "batch", num_seqs)


def launch_config(num_seqs: int, num_heads: int, page_size: int, kv_lora: int = 512,
                  rope: int = 64, dtype=torch.bfloat16) -> dict:  # fmt: skip
    """{block_h, block_n, num_warps, num_stages}: the current GPU's tuned entry for this shape
    at the nearest batch (bf16 inputs only: the sweep's), else `default_config`. The split
    count is the caller's (`num_splits_for`, which counts `default_config`'s head blocks: the
    sweep tunes the tile at that count)."""
    key = table_key(num_seqs, num_heads, kv_lora, rope, page_size)
    path = tuned.gpu_path(TUNED_DIR) if dtype == torch.bfloat16 else None
    return default_config(num_heads, page_size) | tuned.lookup(path, "decode", key)


def _precision(dtype) -> str:
    """fp32 runs as fp32 (the fp32 path is the exactness check; tf32 would cost ~1e-3)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def num_splits_for(
    num_seqs: int,
    num_heads: int,
    max_len: int,
    *,
    num_sms: int = 132,
    max_splits: int = 16,
    min_tokens: int = 256,
) -> int:
    """Splits per sequence so that the grid holds about two programs per SM (one resident at
    a time; the merge costs 2 x splits x B x H x L x 4 bytes), each split keeping at least
    min_tokens tokens. At 64 x 8K: 3 splits of 2 head blocks (6 measured slower), 4 of one
    small-head block (rounded down: 5 leaves a partial last wave, 0.19 against 0.165 ms).
    Host-side integers only (no device sync: graph-safe)."""
    programs = max(1, num_seqs * triton.cdiv(num_heads, default_config(num_heads)["block_h"]))
    if num_heads <= SMALL_HEADS:
        want = max(1, 2 * num_sms // programs)
    else:
        want = triton.cdiv(2 * num_sms, programs)
    return max(1, min(want, max_splits, triton.cdiv(max_len, min_tokens)))


def mla_decode(
    q_BHC,
    pool_PNC,
    page_rows_BP,
    seq_lens_B,
    *,
    kv_lora: int,
    scale: float,
    num_splits: int = 1,
    out_dtype=None,
    config: dict | None = None,
):
    """Absorbed attention of each sequence's H query heads over its first seq_lens[b] cached
    tokens, read in place from the pages page_rows[b] (row of the pool per page).

    q_BHC: [q_lat | q_rope] [B, H, L + R] (the model dtype); pool_PNC: [P, page_size, L + R]
    (last dim contiguous; the pool's dtype must be q's); page_rows_BP: [B, >= pages] int;
    seq_lens_B: [B] int32/int64 device tensor (0 allowed: out 0, lse -inf).
    config: {block_h, block_n, num_warps, num_stages} (default `launch_config`).
    Returns (out [B, H, L] in out_dtype (default q's), lse [B, H] fp32, natural log).
    """
    B, H, C = q_BHC.shape
    L, R = kv_lora, C - kv_lora
    if pool_PNC.shape[-1] != C or pool_PNC.stride(-1) != 1 or pool_PNC.dtype != q_BHC.dtype:
        raise ValueError(
            f"pool {list(pool_PNC.shape)} {pool_PNC.dtype} (stride {pool_PNC.stride()}) does not "
            f"hold tokens of {C} = {L} + {R} contiguous {q_BHC.dtype} values"
        )
    if q_BHC.stride(-1) != 1:
        q_BHC = q_BHC.contiguous()
    out_dtype = out_dtype or q_BHC.dtype
    dev = q_BHC.device
    M = num_splits
    if M == 1:
        part = torch.empty(1, B, H, L, device=dev, dtype=out_dtype)
    else:
        part = torch.empty(M, B, H, L, device=dev, dtype=torch.float32)
    lse = torch.empty(M, B, H, device=dev, dtype=torch.float32)
    if B:
        args = (q_BHC, pool_PNC, page_rows_BP, seq_lens_B, part, lse, H, L, R, M,
                scale * 1.4426950408889634)  # fmt: skip
        if config is not None:  # as asked (a sweep must see the refusal)
            _launch(*args, **config)
        else:
            try:
                _launch(*args, **launch_config(B, H, pool_PNC.shape[1], L, R, q_BHC.dtype))
            except OutOfResources:
                _launch(*args, **FALLBACK)
    if M == 1:
        return part[0], lse[0]
    return merge_lse(part, lse, out_dtype=out_dtype)


def _launch(q, pool, rows, lens, part, lse, H, L, R, M, qk_scale, *, block_h, block_n,
            num_warps, num_stages):  # fmt: skip
    mla_decode_kernel[(triton.cdiv(H, block_h), M, q.shape[0])](
        q, pool, rows, lens, part, lse, H, qk_scale,
        q.stride(0), q.stride(1), pool.stride(0), pool.stride(1), rows.stride(0),
        part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1),
        L=L, R=R, PAGE=pool.shape[1], NUM_SPLITS=M, BLOCK_H=block_h, BLOCK_N=block_n,
        BLOCK_L=triton.next_power_of_2(L), BLOCK_R=max(16, triton.next_power_of_2(R)),
        PRECISION=_precision(q.dtype), SPLIT_SCORES=num_warps == 8, num_warps=num_warps,
        num_stages=num_stages,
    )  # fmt: skip
