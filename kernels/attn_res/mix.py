"""Block AttnRes mixing as one Triton kernel (oracle: `reference.attn_res_mix_reference`).

One program per token. Pass 1, per candidate j: sum of squares and <V_j, gamma * w> over D in
BLOCK_D chunks, score_j = <V_j, gamma * w> / rms(V_j); a softmax over the n scores (a small
vector of NP2 >= n lanes). Pass 2: out = sum_j alpha_j V_j in fp32, stored in the candidates'
dtype. Candidates arrive as separate pointers (slots p0..p15, the first n used; N is a
constexpr), so the bank is never stacked and each pointer keeps its alignment hints. This file's
slot code is unrolled by hand because Triton has no lists of pointers.
Shape legend: n candidates, T tokens, D hidden.
"""

import torch
import triton
import triton.language as tl

from k3kernels.attn_res import MAX_CANDIDATES


@triton.jit
def _score(scores, j: tl.constexpr, p, row, gamma_ptr, q_ptr, D, eps, BLOCK_D: tl.constexpr):
    ss = tl.zeros([BLOCK_D], dtype=tl.float32)
    dot = tl.zeros([BLOCK_D], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        m = d < D
        v = tl.load(p + row * D + d, mask=m, other=0.0).to(tl.float32)
        w = tl.load(gamma_ptr + d, mask=m, other=0.0).to(tl.float32)
        w = w * tl.load(q_ptr + d, mask=m, other=0.0).to(tl.float32)
        ss += v * v
        dot += v * w
    s = tl.sum(dot, axis=0) * tl.rsqrt(tl.sum(ss, axis=0) / D + eps)
    lanes = tl.arange(0, scores.shape[0])
    return tl.where(lanes == j, s, scores)


@triton.jit
def _accumulate(acc, alpha, j: tl.constexpr, p, row, D, d, dmask):
    lanes = tl.arange(0, alpha.shape[0])
    a = tl.sum(tl.where(lanes == j, alpha, 0.0), axis=0)
    return acc + a * tl.load(p + row * D + d, mask=dmask, other=0.0).to(tl.float32)


@triton.jit
def attn_res_mix_kernel(p0, p1, p2, p3, p4, p5, p6, p7, p8, p9, p10, p11, p12, p13, p14, p15,
                        gamma_ptr, q_ptr, out_ptr, D, eps,
                        N: tl.constexpr, NP2: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, NP2)
    scores = tl.full([NP2], float("-inf"), dtype=tl.float32)
    if N > 0:
        scores = _score(scores, 0, p0, row, gamma_ptr, q_ptr, D, eps, BLOCK_D)
    if N > 1:
        scores = _score(scores, 1, p1, row, gamma_ptr, q_ptr, D, eps, BLOCK_D)
    if N > 2:
        scores = _score(scores, 2, p2, row, gamma_ptr, q_ptr, D, eps, BLOCK_D)
    if N > 3:
        scores = _score(scores, 3, p3, row, gamma_ptr, q_ptr, D, eps, BLOCK_D)
    if N > 4:
        scores = _score(scores, 4, p4, row, gamma_ptr, q_ptr, D, eps, BLOCK_D)
    if N > 5:
        scores = _score(scores, 5, p5, row, gamma_ptr, q_ptr, D, eps, BLOCK_D)
    if N > 6:
        scores = _score(scores, 6, p6, row, gamma_ptr, q_ptr, D, eps, BLOCK_D)
    if N > 7:
        scores = _score(scores, 7, p7, row, gamma_ptr, q_ptr, D, eps, BLOCK_D)
    if N > 8:
        scores = _score(scores, 8, p8, row, gamma_ptr, q_ptr, D, eps, BLOCK_D)
    if N > 9:
        scores = _score(scores, 9, p9, row, gamma_ptr, q_ptr, D, eps, BLOCK_D)
    if N > 10:
        scores = _score(scores, 10, p10, row, gamma_ptr, q_ptr, D, eps, BLOCK_D)
    if N > 11:
        scores = _score(scores, 11, p11, row, gamma_ptr, q_ptr, D, eps, BLOCK_D)
    if N > 12:
        scores = _score(scores, 12, p12, row, gamma_ptr, q_ptr, D, eps, BLOCK_D)
    if N > 13:
        scores = _score(scores, 13, p13, row, gamma_ptr, q_ptr, D, eps, BLOCK_D)
    if N > 14:
        scores = _score(scores, 14, p14, row, gamma_ptr, q_ptr, D, eps, BLOCK_D)
    if N > 15:
        scores = _score(scores, 15, p15, row, gamma_ptr, q_ptr, D, eps, BLOCK_D)
    e = tl.exp(scores - tl.max(scores, axis=0))
    e = tl.where(lanes < N, e, 0.0)
    alpha = e / tl.sum(e, axis=0)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        dmask = d < D
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        if N > 0:
            acc = _accumulate(acc, alpha, 0, p0, row, D, d, dmask)
        if N > 1:
            acc = _accumulate(acc, alpha, 1, p1, row, D, d, dmask)
        if N > 2:
            acc = _accumulate(acc, alpha, 2, p2, row, D, d, dmask)
        if N > 3:
            acc = _accumulate(acc, alpha, 3, p3, row, D, d, dmask)
        if N > 4:
            acc = _accumulate(acc, alpha, 4, p4, row, D, d, dmask)
        if N > 5:
            acc = _accumulate(acc, alpha, 5, p5, row, D, d, dmask)
        if N > 6:
            acc = _accumulate(acc, alpha, 6, p6, row, D, d, dmask)
        if N > 7:
            acc = _accumulate(acc, alpha, 7, p7, row, D, d, dmask)
        if N > 8:
            acc = _accumulate(acc, alpha, 8, p8, row, D, d, dmask)
        if N > 9:
            acc = _accumulate(acc, alpha, 9, p9, row, D, d, dmask)
        if N > 10:
            acc = _accumulate(acc, alpha, 10, p10, row, D, d, dmask)
        if N > 11:
            acc = _accumulate(acc, alpha, 11, p11, row, D, d, dmask)
        if N > 12:
            acc = _accumulate(acc, alpha, 12, p12, row, D, d, dmask)
        if N > 13:
            acc = _accumulate(acc, alpha, 13, p13, row, D, d, dmask)
        if N > 14:
            acc = _accumulate(acc, alpha, 14, p14, row, D, d, dmask)
        if N > 15:
            acc = _accumulate(acc, alpha, 15, p15, row, D, d, dmask)
        tl.store(out_ptr + row * D + d, acc.to(out_ptr.dtype.element_ty), mask=dmask)


def attn_res_mix(candidates: list[torch.Tensor], query_D, norm_weight_D, eps: float, *,
                 block_d: int | None = None, num_warps: int = 8):  # fmt: skip
    """Same contract as `reference.attn_res_mix_reference`: n <= MAX_CANDIDATES tensors
    [T, D] of one dtype (made contiguous if they are not) -> [T, D] in that dtype.
    block_d (default min(8192, D rounded up to a power of two)) and num_warps: the launch.
    One H200, 9 candidates of 7168 (`benchmarks/kernels_h200.txt`): 12.0 us per call with
    8192 / 8 warps against 20.0 with 1024 / 4, at 1, 16 and 64 tokens alike."""
    n = len(candidates)
    if not 1 <= n <= MAX_CANDIDATES:
        raise ValueError(f"attn_res_mix takes 1 to {MAX_CANDIDATES} candidates, got {n}")
    cands = [c.contiguous() for c in candidates]
    T, D = cands[0].shape
    for c in cands:
        if c.shape != (T, D) or c.dtype != cands[0].dtype:
            raise ValueError(f"candidates differ: {tuple(c.shape)} {c.dtype} vs "
                             f"{(T, D)} {cands[0].dtype}")  # fmt: skip
    out = torch.empty_like(cands[0])
    if T == 0:
        return out
    slots = cands + [cands[0]] * (MAX_CANDIDATES - n)
    BLOCK_D = block_d or min(8192, triton.next_power_of_2(D))
    NP2 = max(2, triton.next_power_of_2(n))
    attn_res_mix_kernel[(T,)](*slots, norm_weight_D, query_D.reshape(-1), out, D, float(eps),
                              N=n, NP2=NP2, BLOCK_D=BLOCK_D, num_warps=num_warps)  # fmt: skip
    return out
