"""Flash-attention forward for MLA prefill in the expanded form: q/k head dim Dn + R (per-head
nope part plus one rope key shared by all heads), v head dim Dv, causal with a cached-prefix
offset, varlen over the packed batch, fp32 online softmax.

Program (query block, head, sequence): sequence b has q_len new tokens after k_len - q_len
cached ones, its keys and values are rows cu_seqlens_k[b] .. of k/v. New token i sits at
position k_len - q_len + i and sees keys 0 .. that position. Key blocks below the query block's
first position need no mask; only the last (diagonal) blocks do. The grid's query blocks run
heaviest first (the last block of a sequence sees the most keys).

Shape legend: T packed queries, S packed keys, H heads, Dn nope dims, R rope dims, Dv value dims.
"""

from pathlib import Path

import torch
import triton
import triton.language as tl

from k3kernels import tuned


@triton.jit
def _attend_block(q_nope, q_rope, acc, m, denom, kn_base, kr_base, v_base, n0, pos_q, k_len,
                  stride_kn, stride_kr, stride_v, offs_dn, offs_r, offs_dv, qk_scale,
                  DN: tl.constexpr, R: tl.constexpr, DV: tl.constexpr,
                  BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                  PRECISION: tl.constexpr):  # fmt: skip
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < k_len
    kn = tl.load(
        kn_base + offs_n[:, None] * stride_kn + offs_dn[None, :],
        mask=n_ok[:, None] & (offs_dn[None, :] < DN), other=0.0,
    )  # fmt: skip
    kr = tl.load(
        kr_base + offs_n[:, None] * stride_kr + offs_r[None, :],
        mask=n_ok[:, None] & (offs_r[None, :] < R), other=0.0,
    )  # fmt: skip
    s = tl.dot(q_nope, tl.trans(kn), input_precision=PRECISION) + tl.dot(
        q_rope, tl.trans(kr), input_precision=PRECISION
    )  # [BLOCK_M, BLOCK_N]
    s = s * qk_scale
    if MASKED:
        keep = (offs_n[None, :] <= pos_q[:, None]) & n_ok[None, :]
        s = tl.where(keep, s, -float("inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    denom = denom * alpha + tl.sum(p, axis=1)
    v = tl.load(
        v_base + offs_n[:, None] * stride_v + offs_dv[None, :],
        mask=n_ok[:, None] & (offs_dv[None, :] < DV), other=0.0,
    )  # fmt: skip
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, m_new, denom


@triton.jit
def mla_prefill_kernel(
    q_ptr, kn_ptr, kr_ptr, v_ptr, o_ptr, cu_q_ptr, cu_k_ptr, qk_scale,
    stride_qt, stride_qh, stride_knt, stride_knh, stride_krt, stride_vt, stride_vh,
    stride_ot, stride_oh,
    DN: tl.constexpr, R: tl.constexpr, DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_DN: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_DV: tl.constexpr,
    PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (exact products), else "tf32" (unused)
):  # fmt: skip
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2)
    q_start = tl.load(cu_q_ptr + b).to(tl.int64)
    q_len = (tl.load(cu_q_ptr + b + 1) - q_start).to(tl.int32)
    k_start = tl.load(cu_k_ptr + b).to(tl.int64)
    k_len = (tl.load(cu_k_ptr + b + 1) - k_start).to(tl.int32)
    mb = tl.cdiv(q_len, BLOCK_M) - 1 - tl.program_id(0)  # heaviest block first
    if mb < 0:
        return
    offset = k_len - q_len  # cached tokens before the new ones
    offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < q_len
    pos_q = offset + offs_m
    offs_dn = tl.arange(0, BLOCK_DN)
    offs_r = tl.arange(0, BLOCK_R)
    offs_dv = tl.arange(0, BLOCK_DV)

    q_base = q_ptr + (q_start + offs_m[:, None]) * stride_qt + h * stride_qh
    q_nope = tl.load(
        q_base + offs_dn[None, :], mask=m_ok[:, None] & (offs_dn[None, :] < DN), other=0.0
    )
    q_rope = tl.load(
        q_base + DN + offs_r[None, :], mask=m_ok[:, None] & (offs_r[None, :] < R), other=0.0
    )
    kn_base = kn_ptr + k_start * stride_knt + h * stride_knh
    kr_base = kr_ptr + k_start * stride_krt
    v_base = v_ptr + k_start * stride_vt + h * stride_vh

    m = tl.full([BLOCK_M], -float("inf"), dtype=tl.float32)
    denom = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    first_q = offset + mb * BLOCK_M  # every key < first_q is visible to the whole block
    full_end = (first_q // BLOCK_N) * BLOCK_N
    end = tl.minimum(k_len, offset + (mb + 1) * BLOCK_M)
    for n0 in range(0, full_end, BLOCK_N):
        acc, m, denom = _attend_block(
            q_nope, q_rope, acc, m, denom, kn_base, kr_base, v_base, n0, pos_q, k_len,
            stride_knt, stride_krt, stride_vt, offs_dn, offs_r, offs_dv, qk_scale,
            DN, R, DV, BLOCK_N, False, PRECISION,
        )  # fmt: skip
    for n0 in range(full_end, end, BLOCK_N):
        acc, m, denom = _attend_block(
            q_nope, q_rope, acc, m, denom, kn_base, kr_base, v_base, n0, pos_q, k_len,
            stride_knt, stride_krt, stride_vt, offs_dn, offs_r, offs_dv, qk_scale,
            DN, R, DV, BLOCK_N, True, PRECISION,
        )  # fmt: skip
    out = acc / denom[:, None]
    o_base = o_ptr + (q_start + offs_m[:, None]) * stride_ot + h * stride_oh
    o_mask = m_ok[:, None] & (offs_dv[None, :] < DV)
    tl.store(o_base + offs_dv[None, :], out.to(o_ptr.dtype.element_ty), mask=o_mask)


# Launch settings by default (swept on the GPU by `k3batch bench mla-prefill --sweep`); the
# tuned table (`k3kernels.tuned`: table "prefill" of tuned/<GPU>.json, keys `table_key`, written
# with --save-tuned) overrides them at its shapes.
BLOCK_M, BLOCK_N, NUM_WARPS, NUM_STAGES = 128, 64, 8, 2
TUNED_DIR = Path(__file__).with_name("tuned")


def table_key(num_tokens: int, num_heads: int, nope: int, rope: int, v_dim: int) -> str:
    """The tuned-table key of a prefill of num_tokens packed new tokens: heads and head dims;
    the tokens as its size."""
    return tuned.make_key(f"H={num_heads} Dn={nope} R={rope} Dv={v_dim}", "tokens", num_tokens)


def launch_config(num_tokens: int, num_heads: int, nope: int = 128, rope: int = 64,
                  v_dim: int = 128, dtype=torch.bfloat16) -> dict:  # fmt: skip
    """{block_m, block_n, num_warps, num_stages}: the current GPU's tuned entry for this shape
    at the nearest token count (bf16 inputs only: the sweep's; a bf16 tile can exceed shared
    memory in fp32), else the defaults above."""
    key = table_key(num_tokens, num_heads, nope, rope, v_dim)
    path = tuned.gpu_path(TUNED_DIR) if dtype == torch.bfloat16 else None
    defaults = dict(block_m=BLOCK_M, block_n=BLOCK_N, num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    return defaults | tuned.lookup(path, "prefill", key)


def mla_prefill(
    q_THQ,
    k_nope_SHK,
    k_rope_SR,
    v_SHV,
    cu_seqlens_q,
    cu_seqlens_k,
    *,
    max_seqlen_q: int,
    scale: float,
    **config,
):
    """Causal expanded attention of packed new tokens over their sequences' keys.

    q_THQ: [T, H, Dn + R] ([q_nope | q_rope]); k_nope [S, H, Dn], k_rope [S, R] (one key per
    token, all heads), v [S, H, Dv]: any strides with the last dim contiguous (views into the
    kv_b_proj output and the latent are fine). cu_seqlens_q / cu_seqlens_k: [B + 1] int32 or
    int64 device tensors (the model passes its batch's int64 offsets, shared by its layers);
    sequence b's k_len - q_len >= 0 keys before its new tokens are its cached prefix.
    max_seqlen_q: host int >= every q_len (sizes the grid). config: block_m, block_n,
    num_warps, num_stages (default `launch_config`). Returns o [T, H, Dv] in q's dtype.
    Reference: `reference.mla_prefill`.
    """
    T, H, Q = q_THQ.shape
    Dn, Dv = k_nope_SHK.shape[-1], v_SHV.shape[-1]
    R = Q - Dn
    if k_rope_SR.shape[-1] != R:
        raise ValueError(f"k_rope has {k_rope_SR.shape[-1]} dims; q has {Q} = {Dn} + {R}")
    for name, t in (("q", q_THQ), ("k_nope", k_nope_SHK), ("k_rope", k_rope_SR), ("v", v_SHV)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: last dim must be contiguous (strides {t.stride()})")
    o = torch.empty(T, H, Dv, device=q_THQ.device, dtype=q_THQ.dtype)
    B = cu_seqlens_q.shape[0] - 1
    if T == 0 or B == 0:
        return o
    cfg = launch_config(T, H, Dn, R, Dv, q_THQ.dtype) | config
    grid = (triton.cdiv(max_seqlen_q, cfg["block_m"]), H, B)
    mla_prefill_kernel[grid](
        q_THQ, k_nope_SHK, k_rope_SR, v_SHV, o, cu_seqlens_q, cu_seqlens_k,
        scale * 1.4426950408889634,
        q_THQ.stride(0), q_THQ.stride(1), k_nope_SHK.stride(0), k_nope_SHK.stride(1),
        k_rope_SR.stride(0), v_SHV.stride(0), v_SHV.stride(1), o.stride(0), o.stride(1),
        DN=Dn, R=R, DV=Dv, BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"],
        BLOCK_DN=max(16, triton.next_power_of_2(Dn)), BLOCK_R=max(16, triton.next_power_of_2(R)),
        BLOCK_DV=max(16, triton.next_power_of_2(Dv)),
        PRECISION="ieee" if q_THQ.dtype == torch.float32 else "tf32",
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    return o
