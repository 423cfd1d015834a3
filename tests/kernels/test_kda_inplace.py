"""The KDA decode step in place on the cache: state and conv state read from and written to
each sequence's KDA block through block indices, against the out-of-place reference.

Pools are strided views of an arena-like buffer (several layers per block), unused blocks are
poisoned with 1e30 and must be bit-identical afterwards. The Triton conv kernel runs on CPU
through the interpreter (tests/conftest.py sets TRITON_INTERPRET=1 without a GPU), and on CUDA
when there is one; so does the recurrent step (`recurrent_decode`), at K3 shapes on the GPU
(`gpu` marker).
"""

import pytest
import torch
from k3kernels.kda import TOLERANCES
from k3kernels.kda import reference as R

from k3batch.testing import assert_close

POISON = 1e30
DEV = "cuda" if torch.cuda.is_available() else "cpu"


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


@pytest.mark.parametrize("N,C", [(1, 8), (5, 200)], ids=["N1-C8", "N5-C200"])
def test_conv_decode_kernel_matches_reference(N, C):
    from k3kernels.kda.conv_decode import short_conv_decode_

    g = torch.Generator().manual_seed(N + C)
    NB, W, dtype = N + 4, 4, torch.float32
    _, _, conv_buf, conv = _pools(NB, 1, 1, C, W, dtype, g)
    slots = torch.randperm(NB, generator=g)[:N]
    _fill(conv, slots.tolist(), g)
    before = conv_buf.clone()
    x = torch.randn(N, C, generator=g)
    w = torch.randn(C, W, generator=g) * 0.5
    ref_pool = conv[:, 1].clone()
    y_ref = R.short_conv_decode_(x, w, ref_pool, slots)
    y = short_conv_decode_(x.to(DEV), w.to(DEV), conv[:, 1], slots.to(DEV))
    assert_close("conv_y", y_ref, y.cpu(), rel_rms=TOLERANCES[("conv_y", dtype)][0])
    assert torch.equal(conv[:, 1].cpu(), ref_pool), "conv state must be an exact shift"
    touched = torch.zeros(NB, dtype=torch.bool)
    touched[slots] = True
    assert torch.equal(conv_buf[~touched].cpu(), before[~touched].cpu()), "other blocks written"
    rest = [0, 2]  # the other two convs (q and v) of the touched blocks are untouched too
    before_conv = before[:, : conv[0].numel()].view(conv.shape)
    assert torch.equal(conv[touched][:, rest].cpu(), before_conv[touched][:, rest].cpu())


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
