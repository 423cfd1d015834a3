"""The inter-chunk state recurrence of chunked KDA prefill, in place on the cache (Triton).

Chunked KDA (fla's `chunk_kda`) splits each sequence into chunks of BT tokens. The intra-chunk
kernels turn the chunk into WY terms: w and u (so that the chunk's corrected values are
v_new = u - w S for the state S entering it), kg (k scaled to the chunk's end by its gate) and
gk (the chunk-local cumulative log2 gate, per key). What remains is a recurrence over chunks,
per sequence and head, on the fp32 [K, V] state S:

    h[c] = S                                # the state entering chunk c, for the output kernel
    v_new_c = u_c - w_c @ S
    S <- exp2(gk[last token of c])[:, None] * S + kg_c^T @ v_new_c

fla's `chunk_gated_delta_rule_fwd_h` does this from an [N, H, K, V] initial-state tensor into a
new final-state tensor. This kernel reads each sequence's initial state from its arena block
(`state_pool[slots[n]]`, or zeros when `warm[n] == 0`: a fresh sequence's block holds stale
bytes) and writes the final state back to the same block: no gather, no [N, H, K, V]
temporaries, no host read. Its h and v_new plug unchanged into fla's `chunk_gla_fwd_o_gk`.

Program (V block, sequence, head) keeps a [K, BLOCK_V] fp32 tile of S in registers through all
the sequence's chunks; it reads the tile first and writes it last, and no other program touches
it, so the in-place update is race-free. Rounding follows fla's kernel: S enters w @ S in w's
dtype, v_new is stored in u's dtype and enters kg^T @ v_new in kg's dtype (tensor-core
operands), so the kernel matches fla's rounding as well as its layout.
The oracle is `reference.chunk_state_`.

Shape legend: T packed tokens, N sequences, H heads, K key dim, V value dim, NT chunks of the
whole batch (sum over sequences of cdiv(len, BT)), NB blocks of the arena.
"""

import functools
from pathlib import Path

import torch
import triton
import triton.language as tl
from k3kernels import INTERPRETED, tuned
from k3kernels.kda.varlen import CHUNK_SIZE, as_varlen

# Launch settings: the best of 36 on one H200 at k3-slice shapes (96 heads of 128, bf16; 1 x 8,192
# and 4 x 2,048 tokens): 0.447 and 0.400 ms, as fast as fla's autotuned version of this loop
# (0.452, 0.400); 32-wide V blocks took 0.50-0.63 ms (benchmarks/kernels_h200.txt).
# Each program walks its sequence's chunks one after another, so the grid is the parallelism:
# where 64-wide blocks leave most SMs idle (Kimi Linear's 32 heads on one 8K prompt: 64
# programs on 132 SMs) narrower blocks are taken (`pick_block_v`), each re-reading the chunk's
# w and kg tiles in exchange.
# The tuned table (`k3kernels.tuned`: table "chunk_state" of tuned/<GPU>.json, keys
# `table_key`, written by `k3batch bench kda-prefill --sweep --save-tuned`) overrides these and
# the rule at its shapes.
BLOCK_V = 64
NUM_WARPS = 4
NUM_STAGES = 2
TUNED_DIR = Path(__file__).with_name("tuned")


@triton.jit
def chunk_state_prefill_kernel(
    kg,  # [T, H, K]
    w,  # [T, H, K]
    u,  # [T, H, V]
    gk,  # [T, H, K] fp32, chunk-local cumulative log2 gate
    h,  # [NT, H, K, V] out, in kg's dtype
    v_new,  # [T, H, V] out, in u's dtype
    pool,  # [NB, H, K, V] fp32, each block's [H, K, V] contiguous
    slots,  # [N] int
    warm,  # [N] int or bool: nonzero where the block holds the state to continue from
    cu_seqlens,  # [N + 1] int64
    chunk_offsets,  # [N + 1] int64: index in h of each sequence's first chunk
    stride_pb,
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    UPCAST: tl.constexpr,  # the CPU interpreter multiplies bf16 bit patterns as integers
):
    i_v = tl.program_id(0)
    i_nh = tl.program_id(1).to(tl.int64)
    i_n, i_h = i_nh // H, i_nh % H
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    T = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
    boh = tl.load(chunk_offsets + i_n).to(tl.int64)
    slot = tl.load(slots + i_n).to(tl.int64)
    # Rows of the old state to read: K, or none for a cold sequence. (A bound, not a scalar
    # bool in the mask: the interpreter types `bool tensor & bool scalar` as int32.)
    rows_warm = tl.where(tl.load(warm + i_n) != 0, K, 0)

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    p_s = pool + slot * stride_pb + i_h * K * V + o_k[:, None] * V + o_v[None, :]
    m_old = (o_k < rows_warm)[:, None] & m_v[None, :]
    b_s = tl.load(p_s, mask=m_old, other=0.0)  # [BK, BV] fp32

    for i_t in range(0, tl.cdiv(T, BT)):
        o_t = i_t * BT + tl.arange(0, BT)
        m_t = o_t < T
        m_tk, m_tv = m_t[:, None] & m_k[None, :], m_t[:, None] & m_v[None, :]
        p_h = h + ((boh + i_t) * H + i_h) * K * V + o_k[:, None] * V + o_v[None, :]
        tl.store(p_h, b_s.to(h.dtype.element_ty), mask=m_kv)

        off_tk = (bos + o_t)[:, None] * (H * K) + i_h * K + o_k[None, :]  # [BT, BK]
        off_tv = (bos + o_t)[:, None] * (H * V) + i_h * V + o_v[None, :]  # [BT, BV]
        b_w = tl.load(w + off_tk, mask=m_tk, other=0.0)
        b_sw = b_s.to(b_w.dtype)
        if UPCAST:
            b_w, b_sw = b_w.to(tl.float32), b_sw.to(tl.float32)
        b_vn = tl.load(u + off_tv, mask=m_tv, other=0.0).to(tl.float32) - tl.dot(b_w, b_sw)
        tl.store(v_new + off_tv, b_vn.to(v_new.dtype.element_ty), mask=m_tv)

        last = bos + tl.minimum((i_t + 1) * BT, T) - 1
        b_gl = tl.load(gk + last * (H * K) + i_h * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        # kg^T as [BK, BT]: the transposed load avoids a register transpose.
        p_kg = kg + (bos + o_t)[None, :] * (H * K) + i_h * K + o_k[:, None]
        b_kg = tl.load(p_kg, mask=m_k[:, None] & m_t[None, :], other=0.0)
        b_vk = b_vn.to(b_kg.dtype)
        if UPCAST:
            b_kg, b_vk = b_kg.to(tl.float32), b_vk.to(tl.float32)
        b_s = b_s * tl.exp2(b_gl)[:, None] + tl.dot(b_kg, b_vk)

    # Every thread has read its part of the old tile before any thread overwrites it.
    tl.debug_barrier()
    tl.store(p_s, b_s, mask=m_kv)


def chunk_offsets(cu_seqlens: list[int], chunk_size: int) -> list[int]:
    """Index of each sequence's first chunk in the batch's chunk axis, and the total: N+1."""
    out = [0]
    for bos, eos in zip(cu_seqlens[:-1], cu_seqlens[1:]):
        out.append(out[-1] + triton.cdiv(eos - bos, chunk_size))
    return out


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def pick_block_v(num_seqs: int, num_heads: int, v_dim: int, device: torch.device) -> int:
    """BLOCK_V, or the widest narrower block (down to 16) whose grid reaches half the GPU's
    SMs: 64 for k3-slice's 96 heads on one prompt (192 programs), 32 for Kimi Linear's 32
    heads (128 programs on an H100's 132 SMs instead of 64). The interpreter takes BLOCK_V."""
    if device.type != "cuda":
        return BLOCK_V
    want = _num_sms(device) // 2
    block_v = BLOCK_V
    while block_v > 16 and triton.cdiv(v_dim, block_v) * num_seqs * num_heads < want:
        block_v //= 2
    return block_v


def table_key(num_seqs: int, num_heads: int, k_dim: int, v_dim: int) -> str:
    """The tuned-table key of a batch of num_seqs sequences (the grid is V blocks x sequences x
    heads): heads and head dims; the sequences as its size."""
    return tuned.make_key(f"H={num_heads} K={k_dim} V={v_dim}", "seqs", num_seqs)


def launch_config(num_seqs: int, num_heads: int, k_dim: int, v_dim: int,
                  device: torch.device) -> dict:  # fmt: skip
    """{block_v, num_warps, num_stages}: the current GPU's tuned entry for this shape at the
    nearest sequence count, else `pick_block_v` and the defaults above."""
    found = tuned.lookup(tuned.gpu_path(TUNED_DIR), "chunk_state",
                         table_key(num_seqs, num_heads, k_dim, v_dim))  # fmt: skip
    return dict(block_v=pick_block_v(num_seqs, num_heads, v_dim, device), num_warps=NUM_WARPS,
                num_stages=NUM_STAGES) | found  # fmt: skip


def chunk_state_prefill_(kg, w, u, gk, *, state_pool, slots, warm, cu_seqlens,
                         chunk_size: int = 64, block_v: int | None = None,
                         num_warps: int | None = None,
                         num_stages: int | None = None):  # fmt: skip
    """The chunk recurrence for a packed batch, states in place on the cache.

    kg, w: [T, H, K] (k's dtype); u: [T, H, V]; gk: [T, H, K] chunk-local cumulative log2
    gates (fp32); state_pool: [NB, H, K, V] fp32 (a view into the arena, each block's state
    contiguous); slots: [N] distinct int device indices; warm: [N] device ints or bools (0:
    start from zeros); cu_seqlens: N+1 offsets, a host list or a `Varlen` (its device tables
    reused); block_v, num_warps, num_stages: the launch (each by default `launch_config`'s).
    Returns (h [NT, H, K, V] in kg's dtype, the state entering each chunk; v_new [T, H, V] in
    u's dtype). The final states are written to state_pool[slots].
    """
    H, K = kg.shape[1:]
    V = u.shape[-1]
    if state_pool.shape[1:] != (H, K, V) or state_pool.dtype != torch.float32:
        raise ValueError(f"state pool {list(state_pool.shape)} {state_pool.dtype} does not hold "
                         f"[{H}, {K}, {V}] fp32 states")  # fmt: skip
    if not state_pool[0].is_contiguous():
        raise ValueError("each block's KDA state must be contiguous")
    kg, w, u, gk = (t.contiguous() for t in (kg, w, u, gk))
    offsets = chunk_offsets(cu_seqlens, chunk_size)
    N, NT = len(cu_seqlens) - 1, offsets[-1]
    h = kg.new_empty(NT, H, K, V)
    v_new = torch.empty_like(u)
    if N == 0:
        return h, v_new
    if chunk_size == CHUNK_SIZE:  # both tables from the batch's Varlen (one copy a forward)
        varlen = as_varlen(cu_seqlens, kg.device)
        table = (varlen.cu, varlen.chunk_offsets)
    else:  # one host-to-device copy for both, queued without waiting for the device
        table = torch.tensor([list(cu_seqlens), offsets], dtype=torch.long)
        table = table.to(kg.device, non_blocking=True)
    launch = launch_config(N, H, K, V, kg.device)
    num_warps, num_stages = num_warps or launch["num_warps"], num_stages or launch["num_stages"]
    # tl.dot needs every tile dim >= 16; masks cover the padding.
    block_v = max(16, min(block_v or launch["block_v"], triton.next_power_of_2(V)))
    upcast = INTERPRETED and (kg.dtype, w.dtype) != (torch.float32, torch.float32)
    chunk_state_prefill_kernel[(triton.cdiv(V, block_v), N * H)](
        kg, w, u, gk, h, v_new, state_pool, slots, warm, table[0], table[1],
        state_pool.stride(0), H=H, K=K, V=V, BT=chunk_size, BK=max(16, triton.next_power_of_2(K)),
        BV=block_v, UPCAST=upcast, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return h, v_new
