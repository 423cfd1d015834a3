"""One KDA decode step in place on the cache (Triton): the recurrent delta rule for N sequences
with one token each, reading and writing each sequence's [K, V] fp32 state per head straight in
its arena block (`slots`). The oracle is `reference.kda_decode_`.

Program (V block, head, sequence) holds a [K, BLOCK_V] tile of the state in registers: it
normalizes q and k, computes the gate and beta, then S <- exp(g) S; u = beta (v - S^T k);
S <- S + k u^T; o = scale S^T q; and stores the tile back. The step is bound by the state bytes
(read once, written once); the V blocks of one head run side by side (they share the q/k/gate
loads through L1/L2). Measured on one H200 at batch 64 x 96 heads of 128 (`k3batch bench
kda-decode --sweep`): 64-wide V blocks with 4 warps move the state at 3.91 TB/s, 92% of the copy
bandwidth (the whole head with 8 warps: 56%; fla's recurrent kernel, 32-wide: 70%).

Shape legend: N sequences, H heads, K key dim, V value dim, NB blocks of the arena.
"""

from pathlib import Path

import torch
import triton
import triton.language as tl

from k3kernels import tuned

# Launch settings by default (the sweep's best on an H200 at 64 x 96 heads); the tuned table
# (`k3kernels.tuned`: table "decode" of tuned/<GPU>.json, keys `table_key`, written by `k3batch
# bench kda-decode --sweep --save-tuned`) overrides them at its shapes.
BLOCK_V = 64
NUM_WARPS = 4
TUNED_DIR = Path(__file__).with_name("tuned")


@triton.jit
def kda_decode_kernel(
    q_ptr,  # [N, H, K]
    k_ptr,  # [N, H, K]
    v_ptr,  # [N, H, V]
    f_ptr,  # [N, H, K] raw decay logits
    b_ptr,  # [N, H] raw beta logits
    a_log_ptr,  # [H] fp32
    dt_bias_ptr,  # [H * K] fp32
    o_ptr,  # [N, H, V]
    pool_ptr,  # [NB, H, K, V] fp32, each block's [H, K, V] contiguous
    slots_ptr,  # [N] int
    stride_qn,
    stride_kn,
    stride_vn,
    stride_fn,
    stride_bn,
    stride_on,
    stride_pb,
    lower_bound,
    scale,
    K: tl.constexpr,
    V: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BOUNDED: tl.constexpr,  # K3's gate lower_bound * sigmoid(.); else -exp(A) softplus(.)
):
    i_v = tl.program_id(0)
    h = tl.program_id(1)
    n = tl.program_id(2).to(tl.int64)
    kk = tl.arange(0, BLOCK_K)
    vv = i_v * BLOCK_V + tl.arange(0, BLOCK_V)
    k_ok = kk < K
    v_ok = vv < V

    slot = tl.load(slots_ptr + n).to(tl.int64)
    s_ptrs = pool_ptr + slot * stride_pb + h * K * V + kk[:, None] * V + vv[None, :]
    s_mask = k_ok[:, None] & v_ok[None, :]
    S = tl.load(s_ptrs, mask=s_mask, other=0.0)  # issued first: the long-latency read

    q = tl.load(q_ptr + n * stride_qn + h * K + kk, mask=k_ok, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + n * stride_kn + h * K + kk, mask=k_ok, other=0.0).to(tl.float32)
    f = tl.load(f_ptr + n * stride_fn + h * K + kk, mask=k_ok, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + n * stride_vn + h * V + vv, mask=v_ok, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + n * stride_bn + h).to(tl.float32)
    a = tl.exp(tl.load(a_log_ptr + h))
    x = f + tl.load(dt_bias_ptr + h * K + kk, mask=k_ok, other=0.0)

    q = q / tl.sqrt(tl.sum(q * q) + 1e-6) * scale
    k = k / tl.sqrt(tl.sum(k * k) + 1e-6)
    if BOUNDED:
        g = lower_bound * tl.sigmoid(a * x)
    else:
        g = -a * tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x)))  # softplus
    beta = tl.sigmoid(b)

    S = S * tl.exp(g)[:, None]
    u = beta * (v - tl.sum(S * k[:, None], axis=0))
    S = S + k[:, None] * u[None, :]
    o = tl.sum(S * q[:, None], axis=0)
    tl.store(s_ptrs, S, mask=s_mask)
    tl.store(o_ptr + n * stride_on + h * V + vv, o.to(o_ptr.dtype.element_ty), mask=v_ok)


def table_key(num_seqs: int, num_heads: int, k_dim: int, v_dim: int) -> str:
    """The tuned-table key of a step of num_seqs sequences: heads and head dims; the batch as
    its size."""
    return tuned.make_key(f"H={num_heads} K={k_dim} V={v_dim}", "batch", num_seqs)


def launch_config(num_seqs: int, num_heads: int, k_dim: int = 128, v_dim: int = 128) -> dict:
    """{block_v, num_warps}: the current GPU's tuned entry for this shape at the nearest batch,
    else the defaults above (any input dtype: the state, which the tile holds, is fp32)."""
    key = table_key(num_seqs, num_heads, k_dim, v_dim)
    found = tuned.lookup(tuned.gpu_path(TUNED_DIR), "decode", key)
    return dict(block_v=BLOCK_V, num_warps=NUM_WARPS) | found


def kda_decode_(q, k, v, f, b, A_log, dt_bias, *, lower_bound, scale, state_pool, slots,
                **config):  # fmt: skip
    """Same contract as `reference.kda_decode_`: q, k, f [N, H, K]; v [N, H, V]; b [N, H] (any
    float dtype, any row stride); A_log [H]; dt_bias [H * K]; state_pool [NB, H, K, V] fp32 (a
    view into the arena, each block's state contiguous); slots [N] distinct int device indices
    (padding rows point at a scratch block). config: block_v, num_warps (default
    `launch_config`). Returns o [N, H, V] in v's dtype; the states are updated in place."""
    N, H, K = q.shape
    V = v.shape[-1]
    if state_pool.shape[1:] != (H, K, V) or state_pool.dtype != torch.float32:
        raise ValueError(f"state pool {list(state_pool.shape)} {state_pool.dtype} does not hold "
                         f"[{H}, {K}, {V}] fp32 states")  # fmt: skip
    if not state_pool[0].is_contiguous():
        raise ValueError("each block's KDA state must be contiguous")
    # Rows may be strided (the model's q, k, v are column blocks of one conv output, b a
    # column block of its fused projection, read as it comes, bf16 included): no copies.
    q, k, v, f = (t if t.stride(-1) == 1 and t.stride(-2) == t.shape[-1] else t.contiguous()
                  for t in (q, k, v, f))  # fmt: skip
    b = b if b.stride(-1) == 1 else b.contiguous()
    o = torch.empty(N, H, V, device=v.device, dtype=v.dtype)
    if N == 0:
        return o
    cfg = launch_config(N, H, K, V) | config
    block_v = min(cfg["block_v"], triton.next_power_of_2(V))
    kda_decode_kernel[(triton.cdiv(V, block_v), H, N)](
        q, k, v, f, b, A_log.float().contiguous(), dt_bias.float().contiguous(), o, state_pool,
        slots, q.stride(0), k.stride(0), v.stride(0), f.stride(0), b.stride(0), o.stride(0),
        state_pool.stride(0), float(lower_bound or 0.0), float(scale), K=K, V=V,
        BLOCK_K=triton.next_power_of_2(K), BLOCK_V=block_v, BOUNDED=lower_bound is not None,
        num_warps=cfg["num_warps"],
    )  # fmt: skip
    return o
