"""The KDA decode and prefill steps in place on the cache: state read from and written to each
sequence's KDA block through block indices, against the out-of-place reference (the short
convs' kernels: test_kda_conv.py).

Pools are strided views of an arena-like buffer (`kda_inputs`), unused blocks are poisoned with
1e30 and must be bit-identical afterwards; the blocks of fresh (cold) sequences hold NaN, which
must not leak in. The Triton kernels (`recurrent_decode`, `chunk_state`) run on CPU through the
interpreter (tests/conftest.py sets TRITON_INTERPRET=1 without a GPU) at tiny shapes, and on
CUDA at K3 shapes (`gpu` marker), where the fla-composed prefill is also checked against fla's
own `chunk_kda`.
"""

import math

import pytest
import torch
from k3kernels.kda import TOLERANCES
from k3kernels.kda import reference as R
from kda_inputs import DEV, POISON, fill_blocks, offsets, pools, prefill_pools, same_outside

from k3batch.testing import assert_close


def test_reference_decode_in_place_matches_out_of_place():
    g = torch.Generator().manual_seed(0)
    N, H, K, NB = 3, 2, 8, 7
    _, state, _, _ = pools(NB, H, K, 4, 4, torch.float32, g, device="cpu")
    slots = torch.tensor([5, 0, 3])
    fill_blocks(state, slots.tolist(), g)
    h0 = state[slots].clone()
    q, k, v, f = (torch.randn(N, H, K, generator=g) for _ in range(4))
    b, A_log, dt_bias = torch.randn(N, H, generator=g), torch.rand(H), torch.randn(H * K)
    kw = dict(lower_bound=-5.0, scale=K**-0.5)
    o_ref, S_ref = R.kda_core(
        q, k, v, f, b, A_log, dt_bias, initial_state=h0, cu_seqlens=list(range(N + 1)),
        chunked=False, **kw,
    )
    o = R.kda_decode_(q, k, v, f, b, A_log, dt_bias, state_pool=state, slots=slots, **kw)
    assert torch.equal(o, o_ref) and torch.equal(state[slots], S_ref)
    others = [i for i in range(NB) if i not in slots.tolist()]
    assert (state[others] == POISON).all()


def _decode_case(H, K, N, dtype, lower_bound, block_v, device):
    """Our in-place recurrent step against the out-of-place fp32 reference."""
    from k3kernels.kda.recurrent_decode import kda_decode_

    g = torch.Generator().manual_seed(H + N)
    NB = N + 5
    _, state, _, _ = pools(NB, H, K, 4, 4, torch.float32, g, device=device)
    slots = torch.randperm(NB, generator=g)[:N].to(device)
    for s in slots.tolist():
        state[s] = (torch.randn(H, K, K, generator=g) * 0.5).to(device)
    q, k, v, f = (torch.randn(N, H, K, generator=g).to(device, dtype) for _ in range(4))
    b = torch.randn(N, H, generator=g).to(device)
    A_log = torch.rand(H, generator=g).mul(15).add(1).log().to(device)
    dt_bias = (torch.randn(H * K, generator=g) * 0.5 - 1.0).to(device)
    ref_pool = state.clone()
    kw = dict(lower_bound=lower_bound, scale=K**-0.5)
    args = [t.float() for t in (q, k, v, f)] + [b, A_log, dt_bias]
    o_ref = R.kda_decode_(*args, state_pool=ref_pool, slots=slots, **kw)
    o = kda_decode_(q, k, v, f, b, A_log, dt_bias, state_pool=state, slots=slots,
                    block_v=block_v, **kw)  # fmt: skip
    assert_close("o_decode", o_ref, o.float(), rel_rms=TOLERANCES[("o_decode", dtype)][0])
    assert_close(
        "state_decode", ref_pool[slots], state[slots],
        rel_rms=TOLERANCES[("state_decode", dtype)][0],
    )
    others = torch.ones(NB, dtype=torch.bool, device=device)
    others[slots] = False
    assert (state[others] == POISON).all(), "blocks outside the batch were written"


@pytest.mark.parametrize("lower_bound", [-5.0, None], ids=["bounded-gate", "softplus-gate"])
@pytest.mark.parametrize("block_v", [8, 16], ids=["two-v-blocks", "one-v-block"])
def test_decode_kernel_in_place_matches_reference(lower_bound, block_v):
    _decode_case(2, 16, 3, torch.float32, lower_bound, block_v, DEV)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("block_v", [32, 128])
@pytest.mark.parametrize("dt", ["bf16", "fp32"])
def test_decode_kernel_in_place_matches_reference_gpu(dt, block_v):
    """K3 shapes: 96 heads of 128, batch 64."""
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dt]
    _decode_case(96, 128, 64, dtype, -5.0, block_v, "cuda")



# ---- prefill ---------------------------------------------------------------------------------


def _kda_inputs(lens, H, K, V, g):
    """fp32 CPU q, k, f [T, H, K], v [T, H, V], b [T, H], A_log [H], dt_bias [H*K], with A_log
    and dt_bias as `init_random_` draws them."""
    T = sum(lens)
    q, k, f = (torch.randn(T, H, K, generator=g) for _ in range(3))
    v, b = torch.randn(T, H, V, generator=g), torch.randn(T, H, generator=g)
    A_log = torch.rand(H, generator=g).mul(15).add(1).log()
    dt_bias = torch.randn(H * K, generator=g) * 0.5 - 1.0
    return q, k, v, f, b, A_log, dt_bias


def _wy_terms(k, v, g, beta, cu, BT):
    """fp32 (kg, w, u, gk) [T, H, *] as fla's intra-chunk step computes them from the L2-normed
    k, v, the log-decay g and beta (the math of `reference.kda_chunked`): per chunk with
    cumulative decay G, u = L^-1 beta v and w = L^-1 beta exp(G) k with L = I + beta A_kk,
    kg = exp(G_last - G) k, and gk = G in log2 units."""
    kg, w, gk, u = (torch.empty_like(t) for t in (k, k, k, v))
    for n in range(len(cu) - 1):
        for c0 in range(cu[n], cu[n + 1], BT):
            sl = slice(c0, min(c0 + BT, cu[n + 1]))
            G = g[sl].cumsum(0)  # [C, H, K]
            Gh, kh, bh = G.transpose(0, 1), k[sl].transpose(0, 1), beta[sl].t()[..., None]
            below = torch.ones(G.shape[0], G.shape[0], dtype=torch.bool).tril(-1)
            diff = Gh[:, :, None, :] - Gh[:, None, :, :]  # [H, t, s, K]
            decay = torch.where(below[None, :, :, None], diff, float("-inf")).exp()
            L = torch.eye(G.shape[0]) + bh * torch.einsum("htk,hsk,htsk->hts", kh, kh, decay)
            rhs = torch.cat([bh * v[sl].transpose(0, 1), bh * Gh.exp() * kh], dim=-1)
            uw = torch.linalg.solve_triangular(L, rhs, upper=False, unitriangular=True)
            u[sl], w[sl] = uw.transpose(0, 1).split([v.shape[-1], k.shape[-1]], dim=-1)
            kg[sl] = (G[-1:] - G).exp() * k[sl]
            gk[sl] = G / math.log(2)
    return kg, w, u, gk


def _chunk_terms(lens, H, K, V, BT, g):
    """(kg, w, u, gk) of random K3-gated KDA inputs, fp32 on the CPU."""
    _, k, v, f, b, A_log, dt_bias = _kda_inputs(lens, H, K, V, g)
    gate = R.kda_gate(f, A_log, dt_bias, -5.0)
    return _wy_terms(R.l2norm(k), v, gate, torch.sigmoid(b), offsets(lens), BT)


def test_chunk_state_reference_matches_recurrent():
    """The oracle's recurrence on WY terms gives the stepwise delta rule's final states."""
    g = torch.Generator().manual_seed(0)
    lens, H, K, BT = [5, 16, 37, 1], 2, 16, 16
    cu = offsets(lens)
    _, k, v, f, b, A_log, dt_bias = _kda_inputs(lens, H, K, K, g)
    gate, beta, k = R.kda_gate(f, A_log, dt_bias, -5.0), torch.sigmoid(b), R.l2norm(k)
    h0 = torch.randn(len(lens), H, K, K, generator=g)
    _, _, final = R.chunk_state(*_wy_terms(k, v, gate, beta, cu, BT), h0, cu, BT)
    for n in range(len(lens)):
        sl = slice(cu[n], cu[n + 1])
        _, S = R.kda_recurrent(k[sl], k[sl], v[sl], gate[sl], beta[sl], 1.0, h0[n])
        assert_close("state", S, final[n], rel_rms=1e-5)


def _chunk_state_case(lens, warm, H, K, V, BT, dtype, block_v, device):
    """The chunk_state kernel against `reference.chunk_state_` on the same (cast) WY terms; the
    reference runs on the CPU (no TF32)."""
    from k3kernels.kda.chunk_state import chunk_state_prefill_

    g = torch.Generator().manual_seed(sum(lens) + H)
    kg, w, u, gk = _chunk_terms(lens, H, K, V, BT, g)
    kg, w, u = (t.to(dtype) for t in (kg, w, u))
    NB = len(lens) + 3
    buf, state_of, _, _, slots, warm = prefill_pools(NB, H, K, V, 4, 4, dtype, warm, g, device)
    ref_buf, before, cu = buf.to("cpu", copy=True), buf.clone(), offsets(lens)
    h_ref, vn_ref = R.chunk_state_(kg, w, u, gk, state_pool=state_of(ref_buf), slots=slots.cpu(),
                                   warm=warm.cpu(), cu_seqlens=cu, chunk_size=BT)  # fmt: skip
    kg, w, u, gk = (t.to(device) for t in (kg, w, u, gk))
    h, v_new = chunk_state_prefill_(kg, w, u, gk, state_pool=state_of(buf), slots=slots,
                                    warm=warm, cu_seqlens=cu, chunk_size=BT,
                                    block_v=block_v)  # fmt: skip
    assert h.dtype == dtype and v_new.dtype == dtype
    state_ref, state = state_of(ref_buf)[slots.cpu()], state_of(buf)[slots]
    for name, ref, out in (("chunk_h", h_ref, h), ("chunk_v_new", vn_ref, v_new),
                           ("chunk_state", state_ref, state)):  # fmt: skip
        assert_close(name, ref, out.float(), rel_rms=TOLERANCES[(name, dtype)][0])
    assert same_outside(buf, before, state_of, slots), "bytes outside the batch's states written"


@pytest.mark.parametrize(
    "dt,block_v,warm_dtype",
    [("fp32", 16, torch.long), ("bf16", 32, torch.bool)],
    ids=["fp32-two-v-blocks-warm-int", "bf16-one-v-block-warm-bool"],
)
def test_chunk_state_kernel_in_place_matches_reference(dt, block_v, warm_dtype):
    """H=2, K=16, V=32, chunks of 16: sequences shorter than, equal to and over a chunk, warm
    and cold (a cold block holds NaN)."""
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dt]
    warm = [True, False, True, False] if warm_dtype == torch.bool else [1, 0, 1, 0]
    _chunk_state_case([5, 16, 37, 1], warm, 2, 16, 32, 16, dtype, block_v, DEV)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dt", ["bf16", "fp32"])
def test_chunk_state_kernel_in_place_matches_reference_gpu(dt):
    """K3 heads of 128, chunks of 64, sequences of 1000, 64 and 37 tokens (4 heads: the
    CPU-built WY terms are the slow part; heads are independent programs)."""
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dt]
    _chunk_state_case([1000, 64, 37], [1, 0, 1], 4, 128, 128, 64, dtype, 32, "cuda")


def test_reference_prefill_in_place_matches_out_of_place():
    """The CPU path: `kda_prefill_` / `short_conv_prefill_` equal the out-of-place ops on the
    gathered states (zeros for cold sequences, whatever their blocks hold)."""
    g = torch.Generator().manual_seed(1)
    lens, warm_list, H, K, C, W = [3, 1, 9], [1, 0, 1], 2, 8, 12, 4
    state_buf, state_of, conv_buf, conv_of, slots, warm = prefill_pools(
        6, H, K, K, C, W, torch.float32, warm_list, g, "cpu"
    )
    keep = torch.tensor(warm_list, dtype=torch.bool)
    h0 = torch.where(keep[:, None, None, None], state_of(state_buf)[slots], 0.0)
    c0 = torch.where(keep[:, None, None], conv_of(conv_buf)[slots], 0.0)
    args = _kda_inputs(lens, H, K, K, g)
    kw = dict(lower_bound=-5.0, scale=K**-0.5, cu_seqlens=offsets(lens))
    o_ref, S_ref = R.kda_core(*args, initial_state=h0, chunked=True, **kw)
    q, k = R.l2norm(args[0]), R.l2norm(args[1])  # as the conv leaves them
    o = R.kda_prefill_(q, k, *args[2:], state_pool=state_of(state_buf), slots=slots, warm=warm,
                       **kw)  # fmt: skip
    assert torch.equal(o, o_ref) and torch.equal(state_of(state_buf)[slots], S_ref)
    x, w = torch.randn(sum(lens), C, generator=g), torch.randn(C, W, generator=g)
    y_ref, s_ref = R.short_conv(x, w, c0, offsets(lens))
    (y,) = R.short_conv_prefill_(x, w, conv_of(conv_buf), slots, warm, offsets(lens))
    assert torch.equal(y, y_ref) and torch.equal(conv_of(conv_buf)[slots], s_ref)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dt", ["bf16", "fp32"])
def test_fla_kda_prefill_in_place_matches_chunk_kda(dt):
    """K3 slice (96 heads of 128, the bounded gate with safe_gate): the fla-composed in-place
    prefill against fla's `chunk_kda` on the gathered states (zeros for the cold sequence),
    both within the fla-vs-reference tolerances; other bytes of the pool untouched."""
    from k3kernels.kda import fla

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dt]
    g = torch.Generator().manual_seed(3)
    lens, warm_list, H, K = [1000, 64, 37], [1, 0, 1], 96, 128
    buf, state_of, _, _, slots, warm = prefill_pools(
        len(lens) + 2, H, K, K, 4, 4, dtype, warm_list, g, "cuda"
    )
    keep = torch.tensor(warm_list, dtype=torch.bool, device="cuda")
    h0 = torch.where(keep[:, None, None, None], state_of(buf)[slots], 0.0)
    q, k, v, f, b, A_log, dt_bias = _kda_inputs(lens, H, K, K, g)
    args = [t.to("cuda", dtype) for t in (q, k, v, f)] + [t.cuda() for t in (b, A_log, dt_bias)]
    kw = dict(lower_bound=-5.0, scale=K**-0.5, cu_seqlens=offsets(lens))
    o_ref, S_ref = fla.kda_prefill(*args, initial_state=h0, **kw)
    before = buf.clone()
    qk = [R.l2norm(t).to(dtype).cuda() for t in (q, k)]  # as the conv leaves them
    o = fla.kda_prefill_(*qk, *args[2:], state_pool=state_of(buf), slots=slots, warm=warm, **kw)
    assert o.dtype == dtype and o.shape == o_ref.shape
    assert_close("o", o_ref, o, rel_rms=TOLERANCES[("o", dtype)][0])
    assert_close("state", S_ref, state_of(buf)[slots], rel_rms=TOLERANCES[("state", dtype)][0])
    assert same_outside(buf, before, state_of, slots), "bytes outside the batch's states written"
