"""The KDA decode and prefill steps in place on the cache: state and conv state read from and
written to each sequence's KDA block through block indices, against the out-of-place reference.

Pools are strided views of an arena-like buffer (several layers per block), unused blocks are
poisoned with 1e30 and must be bit-identical afterwards; the blocks of fresh (cold) sequences
hold NaN, which must not leak in. The Triton kernels (`conv_decode`, `recurrent_decode`,
`conv_prefill`, `chunk_state`) run on CPU through the interpreter (tests/conftest.py sets
TRITON_INTERPRET=1 without a GPU) at tiny shapes, and on CUDA at K3 shapes (`gpu` marker), where
the fla-composed prefill is also checked against fla's own `chunk_kda`.
"""

import math

import pytest
import torch
from k3kernels.kda import TOLERANCES
from k3kernels.kda import reference as R

from k3batch.testing import assert_close

POISON = 1e30
DEV = "cuda" if torch.cuda.is_available() else "cpu"
# Triton's interpreter rounds fp32 to bf16 toward zero (the GPU rounds to nearest): about half
# of a bf16 output lands one ulp low, ~4e-3 relative RMS, where the GPU flips an ulp rarely.
INTERPRETED_BF16_ROUNDING = 1e-2


def _pools(NB, H, K, C, W, dtype, g, device=DEV):
    """(state [NB, H, K, K] fp32, conv [NB, 3, C, W-1]) views into one block buffer that also
    holds another layer's bytes, poisoned."""
    state_elems, conv_elems = H * K * K, 3 * C * (W - 1)
    state_buf = torch.full((NB, 2 * state_elems), POISON, device=device)
    conv_buf = torch.full((NB, 2 * conv_elems), POISON, dtype=dtype, device=device)
    state = state_buf[:, state_elems:].view(NB, H, K, K)
    conv = conv_buf[:, :conv_elems].view(NB, 3, C, W - 1)
    return state_buf, state, conv_buf, conv


def _fill(view, slots, g):
    for s in slots:
        view[s] = torch.randn(view.shape[1:], generator=g).to(view.dtype)


@pytest.mark.parametrize(
    "N,C,block_c,w_dtype",
    [(1, 8, None, torch.float32), (5, 200, None, torch.float32), (5, 200, 64, torch.bfloat16)],
    ids=["N1-C8", "N5-C200", "N5-C200-blocks64-bf16w"],
)
def test_conv_decode_kernel_matches_reference(N, C, block_c, w_dtype):
    """Against the reference; with bf16 weights (read as they are: no fp32 copy per call) and
    several channel blocks per sequence (block_c) too."""
    from k3kernels.kda.conv_decode import short_conv_decode_

    g = torch.Generator().manual_seed(N + C)
    NB, W, dtype = N + 4, 4, torch.float32
    _, _, conv_buf, conv = _pools(NB, 1, 1, C, W, dtype, g)
    slots = torch.randperm(NB, generator=g)[:N]
    _fill(conv, slots.tolist(), g)
    before = conv_buf.clone()
    x = torch.randn(N, C, generator=g)
    w = (torch.randn(C, W, generator=g) * 0.5).to(w_dtype)
    ref_pool = conv[:, 1].cpu().clone()  # the reference runs on the CPU
    y_ref = R.short_conv_decode_(x, w, ref_pool, slots)
    y = short_conv_decode_(x.to(DEV), w.to(DEV), conv[:, 1], slots.to(DEV), block_c)
    assert_close("conv_y", y_ref, y.cpu(), rel_rms=TOLERANCES[("conv_y", dtype)][0])
    assert torch.equal(conv[:, 1].cpu(), ref_pool), "conv state must be an exact shift"
    touched = torch.zeros(NB, dtype=torch.bool)
    touched[slots] = True
    assert torch.equal(conv_buf[~touched].cpu(), before[~touched].cpu()), "other blocks written"
    rest = [0, 2]  # the other two convs (q and v) of the touched blocks are untouched too
    before_conv = before[:, : conv[0].numel()].view(conv.shape)
    assert torch.equal(conv[touched][:, rest].cpu(), before_conv[touched][:, rest].cpu())


@pytest.mark.parametrize(
    "block_c,dt", [(16, "fp32"), (128, "bf16")], ids=["BC16-tail-block-fp32", "BC128-bf16"]
)
def test_conv_decode_kernel_qkv_in_one_launch(block_c, dt):
    """The model's decode conv: q, k and v as one 3C-channel launch over the whole conv cache of
    a block ([3, C, W-1] flattened), its input a strided column block of the fused projection,
    equals three separate reference convs (each on its part of the cache)."""
    from k3kernels.kda.conv_decode import short_conv_decode_

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dt]
    g = torch.Generator().manual_seed(7)
    N, C, W, NB = 3, 24, 4, 6
    _, _, conv_buf, conv = _pools(NB, 1, 1, C, W, dtype, g)
    slots = torch.tensor([4, 0, 2])
    _fill(conv, slots.tolist(), g)
    before = conv_buf.clone()
    proj = torch.randn(N, 3 * C + 5, generator=g).to(dtype)  # q | k | v | other projections
    w = torch.randn(3, C, W, generator=g) * 0.5
    ref_pools = conv.cpu().clone()
    parts = [proj[:, j * C : (j + 1) * C] for j in range(3)]
    y_ref = torch.cat([R.short_conv_decode_(parts[j], w[j], ref_pools[:, j], slots)
                       for j in range(3)], dim=1)  # fmt: skip
    x = proj.to(DEV)[:, : 3 * C]
    y = short_conv_decode_(x, w.flatten(0, 1).to(DEV), conv.flatten(1, 2), slots.to(DEV), block_c)
    rel_rms = TOLERANCES[("conv_y", dtype)][0]
    if DEV == "cpu" and dtype == torch.bfloat16:  # interpreted (tests/conftest.py)
        rel_rms = INTERPRETED_BF16_ROUNDING
    assert_close("conv_y", y_ref, y.cpu(), rel_rms=rel_rms)
    assert torch.equal(conv[slots].cpu(), ref_pools[slots]), "conv states must be exact shifts"
    others = [i for i in range(NB) if i not in slots.tolist()]
    assert torch.equal(conv_buf[others].cpu(), before[others].cpu()), "other blocks written"
    layer = conv[0].numel()  # the other layer's bytes of the touched blocks
    assert torch.equal(conv_buf[:, layer:].cpu(), before[:, layer:].cpu())


def test_reference_decode_in_place_matches_out_of_place():
    g = torch.Generator().manual_seed(0)
    N, H, K, NB = 3, 2, 8, 7
    _, state, _, _ = _pools(NB, H, K, 4, 4, torch.float32, g, device="cpu")
    slots = torch.tensor([5, 0, 3])
    _fill(state, slots.tolist(), g)
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
    _, state, _, _ = _pools(NB, H, K, 4, 4, torch.float32, g, device=device)
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


def _cu(lens):
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return out


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
    return _wy_terms(R.l2norm(k), v, gate, torch.sigmoid(b), _cu(lens), BT)


def _prefill_pools(NB, H, K, V, C, W, conv_dtype, warm, g, device, qkv=False):
    """Poisoned state and conv buffers with views as `_pools`, K != V allowed; random distinct
    blocks for the sequences, holding a random state if warm, NaN if cold (stale bytes).
    Returns (state_buf, state_view_fn, conv_buf, conv_view_fn, slots, warm) where *_view_fn
    maps a buffer (or its clone) to the pool view the kernels take: the k conv's [NB, C, W-1],
    or with qkv the layer's three convs as one [NB, 3C, W-1] (as the model convolves them)."""
    hkv, cw = H * K * V, 3 * C * (W - 1)
    state_buf = torch.full((NB, 2 * hkv), POISON, device=device)
    conv_buf = torch.full((NB, 2 * cw), POISON, dtype=conv_dtype, device=device)

    def state_of(buf):
        return buf[:, hkv:].view(NB, H, K, V)

    def conv_of(buf):  # a strided view
        convs = buf[:, :cw].view(NB, 3, C, W - 1)
        return convs.flatten(1, 2) if qkv else convs[:, 1]

    slots = torch.randperm(NB, generator=g)[: len(warm)]
    for s, is_warm in zip(slots.tolist(), warm):
        state_of(state_buf)[s] = (torch.randn(H, K, V, generator=g) * 0.5) if is_warm else math.nan
        shape = conv_of(conv_buf).shape[1:]
        conv_of(conv_buf)[s] = torch.randn(shape, generator=g) if is_warm else math.nan
    warm_t = torch.tensor(warm, device=device)
    return state_buf, state_of, conv_buf, conv_of, slots.to(device), warm_t


def _same_outside(buf, before, view_of, slots) -> bool:
    """The buffer equals `before` bit for bit (NaN included) outside view_of(buf)[slots]."""
    a, b = buf.clone(), before.clone()
    view_of(a)[slots] = 0
    view_of(b)[slots] = 0
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_chunk_state_reference_matches_recurrent():
    """The oracle's recurrence on WY terms gives the stepwise delta rule's final states."""
    g = torch.Generator().manual_seed(0)
    lens, H, K, BT = [5, 16, 37, 1], 2, 16, 16
    cu = _cu(lens)
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
    buf, state_of, _, _, slots, warm = _prefill_pools(NB, H, K, V, 4, 4, dtype, warm, g, device)
    ref_buf, before, cu = buf.to("cpu", copy=True), buf.clone(), _cu(lens)
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
    assert _same_outside(buf, before, state_of, slots), "bytes outside the batch's states written"


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


def _conv_case(lens, warm, C, dtype, block_t, block_c, device, W=4, **parts):
    """The conv_prefill kernel against `reference.short_conv_prefill_` (on the CPU: cuDNN's
    fp32 conv may use TF32): y within tolerance, the conv state exact, every other byte of the
    buffer untouched. parts: num_parts, norm_parts, head_dim of both."""
    from k3kernels.kda.conv_prefill import short_conv_prefill_

    g = torch.Generator().manual_seed(sum(lens) + C)
    NB = len(lens) + 3
    _, _, buf, conv_of, slots, warm = _prefill_pools(NB, 1, 1, 1, C, W, dtype, warm, g, device)
    x = torch.randn(sum(lens), C, generator=g).to(dtype)
    w = torch.randn(C, W, generator=g) * 0.5
    ref_buf, before, cu = buf.to("cpu", copy=True), buf.clone(), _cu(lens)
    y_ref = R.short_conv_prefill_(x, w, conv_of(ref_buf), slots.cpu(), warm.cpu(), cu, **parts)
    y = short_conv_prefill_(x.to(device), w.to(device), conv_of(buf), slots, warm, cu,
                            block_t=block_t, block_c=block_c, **parts)  # fmt: skip
    assert y.dtype == dtype
    rel_rms = TOLERANCES[("conv_y", dtype)][0]
    if device == "cpu" and dtype == torch.bfloat16:  # interpreted (tests/conftest.py)
        rel_rms = INTERPRETED_BF16_ROUNDING
    assert_close("conv_y", y_ref, y, rel_rms=rel_rms)
    state_ref, state = conv_of(ref_buf)[slots.cpu()], conv_of(buf)[slots]
    assert torch.equal(state.cpu(), state_ref), "conv state must be an exact copy of inputs"
    assert _same_outside(buf, before, conv_of, slots), "bytes outside the batch's states written"


@pytest.mark.parametrize("block_c", [8, 16], ids=["BC8-blocks-in-parts", "BC16-blocks-straddle"])
def test_conv_prefill_kernel_qkv_in_one_launch(block_c):
    """The model's prefill conv: q, k and v as one 3C-channel launch over the layer's whole conv
    cache ([NB, 3, C, W-1] flattened), its input a strided column block of the fused projection,
    its output three contiguous [T, C] parts; equal to three separate reference convs, each on
    its own part of the cache. C = 24: 16-channel blocks straddle the parts."""
    from k3kernels.kda.conv_prefill import short_conv_prefill_

    g = torch.Generator().manual_seed(11)
    lens, warm, C, W = [1, 2, 9, 20], [1, 0, 1, 0], 24, 4
    _, _, buf, conv_of, slots, warm = _prefill_pools(len(lens) + 2, 1, 1, 1, C, W, torch.float32,
                                                     warm, g, DEV, qkv=True)  # fmt: skip
    proj = torch.randn(sum(lens), 3 * C + 5, generator=g)  # q | k | v | other projections
    w = torch.randn(3 * C, W, generator=g) * 0.5
    ref_buf, before, cu = buf.to("cpu", copy=True), buf.clone(), _cu(lens)
    start = buf.to("cpu", copy=True)  # (the reference writes the states of a CPU `before`)
    ref_parts = ref_buf[:, : 3 * C * (W - 1)].view(-1, 3, C, W - 1)
    y_ref = [R.short_conv_prefill_(proj[:, j * C : (j + 1) * C], w[j * C : (j + 1) * C],
                                   ref_parts[:, j], slots.cpu(), warm.cpu(), cu)[0]
             for j in range(3)]  # fmt: skip
    y = short_conv_prefill_(proj.to(DEV)[:, : 3 * C], w.to(DEV), conv_of(buf), slots, warm, cu,
                            num_parts=3, block_t=8, block_c=block_c)  # fmt: skip
    assert y.shape == (3, sum(lens), C) and y.is_contiguous()
    rel_rms = TOLERANCES[("conv_y", torch.float32)][0]
    for j in range(3):
        assert_close("conv_y", y_ref[j], y[j].cpu(), rel_rms=rel_rms)
    assert torch.equal(conv_of(buf)[slots].cpu(), conv_of(ref_buf)[slots.cpu()])
    assert _same_outside(buf, before, conv_of, slots), "bytes outside the batch's states written"
    # The reference's parts are those of one conv over the 3C channels.
    ref = R.short_conv_prefill_(proj[:, : 3 * C], w, conv_of(before.cpu()), slots.cpu(),
                                warm.cpu(), cu, num_parts=3)  # fmt: skip
    assert torch.equal(ref, torch.stack(y_ref))
    # As the model runs it: q and k (the first two parts) L2-normed over heads of 8 channels
    # (the reference: the same conv, each head's norm; v as before), the state as before.
    ref_normed = R.short_conv_prefill_(proj[:, : 3 * C], w, conv_of(start.clone()), slots.cpu(),
                                       warm.cpu(), cu, num_parts=3, norm_parts=2, head_dim=8)
    buf.copy_(start)
    y = short_conv_prefill_(proj.to(DEV)[:, : 3 * C], w.to(DEV), conv_of(buf), slots, warm, cu,
                            num_parts=3, norm_parts=2, head_dim=8, block_t=8,
                            block_c=block_c)  # fmt: skip
    heads = ref_normed[:2].unflatten(-1, (-1, 8))
    assert torch.allclose(heads.norm(dim=-1), torch.ones(()), atol=1e-5)
    assert torch.equal(ref_normed[2], ref[2])
    assert_close("conv_y_normed", ref_normed, y.cpu(), rel_rms=rel_rms)
    assert torch.equal(conv_of(buf)[slots].cpu(), conv_of(ref_buf)[slots.cpu()])
    with pytest.raises(ValueError, match="L2 norm"):  # a head across two blocks
        short_conv_prefill_(proj.to(DEV)[:, : 3 * C], w.to(DEV), conv_of(buf), slots, warm, cu,
                            num_parts=3, norm_parts=2, head_dim=8 * block_c // 4,
                            block_c=block_c)  # fmt: skip


@pytest.mark.parametrize("dt", ["fp32", "bf16"])
def test_conv_prefill_kernel_in_place_matches_reference(dt):
    """Sequences of 1 and 2 tokens (< W-1: the old state shifts), warm and cold, one over
    several token blocks; C=40 over three channel blocks."""
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dt]
    _conv_case([1, 2, 2, 7, 21], [1, 1, 0, 0, 1], 40, dtype, 8, 16, DEV)


@pytest.mark.parametrize("W", [2, 3])
def test_conv_prefill_kernel_narrower_windows(W):
    """Widths under 4 (the kernel's window holds up to 3 rows; its oldest taps are zeros), warm
    and cold sequences shorter than the window; a width over 4 is refused."""
    from k3kernels.kda.conv_prefill import short_conv_prefill_

    _conv_case([1, 2, 11], [1, 0, 1], 16, torch.float32, 8, 16, DEV, W=W)
    x, pool = torch.zeros(4, 8, device=DEV), torch.zeros(2, 8, 4, device=DEV)
    with pytest.raises(ValueError, match="conv width 5"):
        short_conv_prefill_(x, torch.zeros(8, 5, device=DEV), pool, torch.tensor([0], device=DEV),
                            torch.tensor([0], device=DEV), [0, 4])  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dt", ["bf16", "fp32"])
@pytest.mark.parametrize("qk", ["plain", "qk-normed"])
def test_conv_prefill_kernel_in_place_matches_reference_gpu(dt, qk):
    """K3 width (96 heads of 128; qk-normed: as Kimi Linear's model runs it, q | k | v of 32
    heads each, q and k L2-normed per head), default blocks."""
    from k3kernels.kda.conv_prefill import BLOCK_C, BLOCK_T

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dt]
    parts = dict(num_parts=3, norm_parts=2, head_dim=128) if qk == "qk-normed" else {}
    _conv_case([1000, 64, 37, 2, 1], [1, 0, 1, 1, 0], 96 * 128, dtype, BLOCK_T, BLOCK_C, "cuda",
               **parts)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("head_dim", [128, 96], ids=["heads-in-blocks", "heads-by-fla-norm"])
def test_fla_conv_prefill_norms_q_and_k_at_any_head_dim_gpu(head_dim):
    """The model's conv through the fla backend: q and k L2-normed in the conv's kernel where
    its channel blocks hold whole heads (128), by fla's L2 norm after it elsewhere (96), both
    against the reference (fp32)."""
    from k3kernels.kda import fla

    g = torch.Generator().manual_seed(head_dim)
    lens, warm, C, W = [300, 37, 1], [1, 0, 1], 4 * head_dim, 4
    _, _, buf, conv_of, slots, warm = _prefill_pools(len(lens) + 2, 1, 1, 1, C, W, torch.float32,
                                                     warm, g, "cuda", qkv=True)  # fmt: skip
    x, w = torch.randn(sum(lens), 3 * C, generator=g), torch.randn(3 * C, W, generator=g) * 0.5
    ref_buf, cu = buf.to("cpu", copy=True), _cu(lens)
    ref = R.short_conv_prefill_(x, w, conv_of(ref_buf), slots.cpu(), warm.cpu(), cu, 3, 2,
                                head_dim)  # fmt: skip
    y = fla.short_conv_prefill_(x.cuda(), w.cuda(), conv_of(buf), slots, warm, cu, 3, 2, head_dim)
    assert_close("conv_y_normed", ref, y.cpu(), rel_rms=TOLERANCES[("conv_y", torch.float32)][0])
    assert torch.equal(conv_of(buf)[slots].cpu(), conv_of(ref_buf)[slots.cpu()])


def test_reference_prefill_in_place_matches_out_of_place():
    """The CPU path: `kda_prefill_` / `short_conv_prefill_` equal the out-of-place ops on the
    gathered states (zeros for cold sequences, whatever their blocks hold)."""
    g = torch.Generator().manual_seed(1)
    lens, warm_list, H, K, C, W = [3, 1, 9], [1, 0, 1], 2, 8, 12, 4
    state_buf, state_of, conv_buf, conv_of, slots, warm = _prefill_pools(
        6, H, K, K, C, W, torch.float32, warm_list, g, "cpu"
    )
    keep = torch.tensor(warm_list, dtype=torch.bool)
    h0 = torch.where(keep[:, None, None, None], state_of(state_buf)[slots], 0.0)
    c0 = torch.where(keep[:, None, None], conv_of(conv_buf)[slots], 0.0)
    args = _kda_inputs(lens, H, K, K, g)
    kw = dict(lower_bound=-5.0, scale=K**-0.5, cu_seqlens=_cu(lens))
    o_ref, S_ref = R.kda_core(*args, initial_state=h0, chunked=True, **kw)
    q, k = R.l2norm(args[0]), R.l2norm(args[1])  # as the conv leaves them
    o = R.kda_prefill_(q, k, *args[2:], state_pool=state_of(state_buf), slots=slots, warm=warm,
                       **kw)  # fmt: skip
    assert torch.equal(o, o_ref) and torch.equal(state_of(state_buf)[slots], S_ref)
    x, w = torch.randn(sum(lens), C, generator=g), torch.randn(C, W, generator=g)
    y_ref, s_ref = R.short_conv(x, w, c0, _cu(lens))
    (y,) = R.short_conv_prefill_(x, w, conv_of(conv_buf), slots, warm, _cu(lens))
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
    buf, state_of, _, _, slots, warm = _prefill_pools(
        len(lens) + 2, H, K, K, 4, 4, dtype, warm_list, g, "cuda"
    )
    keep = torch.tensor(warm_list, dtype=torch.bool, device="cuda")
    h0 = torch.where(keep[:, None, None, None], state_of(buf)[slots], 0.0)
    q, k, v, f, b, A_log, dt_bias = _kda_inputs(lens, H, K, K, g)
    args = [t.to("cuda", dtype) for t in (q, k, v, f)] + [t.cuda() for t in (b, A_log, dt_bias)]
    kw = dict(lower_bound=-5.0, scale=K**-0.5, cu_seqlens=_cu(lens))
    o_ref, S_ref = fla.kda_prefill(*args, initial_state=h0, **kw)
    before = buf.clone()
    qk = [R.l2norm(t).to(dtype).cuda() for t in (q, k)]  # as the conv leaves them
    o = fla.kda_prefill_(*qk, *args[2:], state_pool=state_of(buf), slots=slots, warm=warm, **kw)
    assert o.dtype == dtype and o.shape == o_ref.shape
    assert_close("o", o_ref, o, rel_rms=TOLERANCES[("o", dtype)][0])
    assert_close("state", S_ref, state_of(buf)[slots], rel_rms=TOLERANCES[("state", dtype)][0])
    assert _same_outside(buf, before, state_of, slots), "bytes outside the batch's states written"
