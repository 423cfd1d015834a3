"""The torch KDA reference against fla's naive references (they run on CPU), and its chunked
form against its stepwise form. fp32 throughout; tolerances are fp32 rounding over <= 1000 steps."""

import pytest
import torch
import torch.nn.functional as F
from k3kernels.kda import reference as R

fla_naive = pytest.importorskip("fla.ops.kda.naive")
fla_gate = pytest.importorskip("fla.ops.kda.gate")


def _inputs(T, H=3, K=16, V=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return dict(
        q=r(T, H, K),
        k=r(T, H, K),
        v=r(T, H, V),
        f=r(T, H, K),
        b=r(T, H),
        A_log=torch.rand(H, generator=g) * 2,
        dt_bias=r(H * K),
        S0=r(H, K, V),
    )


@pytest.mark.parametrize("lower_bound", [-5.0, None], ids=["k3-bounded", "kimi-linear-softplus"])
def test_gate_matches_fla_naive(lower_bound):
    x = _inputs(33)
    ours = R.kda_gate(x["f"], x["A_log"], x["dt_bias"], lower_bound)
    if lower_bound is None:
        ref = fla_gate.naive_kda_gate(x["f"], x["A_log"], x["dt_bias"])
    else:
        ref = fla_gate.naive_kda_lowerbound_gate(x["f"], x["A_log"], x["dt_bias"], lower_bound)
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-6)
    if lower_bound is not None:
        assert ours.min() >= lower_bound and ours.max() <= 0  # sigmoid saturates in fp32


@pytest.mark.parametrize("T", [1, 37, 130])
def test_recurrent_matches_fla_naive(T):
    x = _inputs(T)
    q, k = R.l2norm(x["q"]), R.l2norm(x["k"])
    g, beta = R.kda_gate(x["f"], x["A_log"], x["dt_bias"], -5.0), torch.sigmoid(x["b"])
    o, S = R.kda_recurrent(q, k, x["v"], g, beta, 16**-0.5, x["S0"])
    o_ref, S_ref = fla_naive.naive_recurrent_kda(
        q[None], k[None], x["v"][None], g[None], beta[None], 16**-0.5, x["S0"][None], True
    )
    torch.testing.assert_close(o, o_ref[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(S, S_ref[0], rtol=0, atol=1e-5)


@pytest.mark.parametrize("T,chunk", [(1, 64), (63, 64), (64, 64), (130, 64), (1000, 64), (45, 16)])
def test_chunked_matches_recurrent(T, chunk):
    x = _inputs(T, seed=T)
    q, k = R.l2norm(x["q"]), R.l2norm(x["k"])
    g, beta = R.kda_gate(x["f"], x["A_log"], x["dt_bias"], -5.0), torch.sigmoid(x["b"])
    o1, S1 = R.kda_recurrent(q, k, x["v"], g, beta, 0.25, x["S0"])
    o2, S2 = R.kda_chunked(q, k, x["v"], g, beta, 0.25, x["S0"], chunk_size=chunk)
    torch.testing.assert_close(o2, o1, rtol=0, atol=2e-5)
    torch.testing.assert_close(S2, S1, rtol=0, atol=2e-5)


def test_core_varlen_equals_per_sequence():
    lens = [5, 1, 70]
    x = _inputs(sum(lens))
    cu = [0, 5, 6, 76]
    S0 = torch.randn(3, 3, 16, 12)
    args = dict(lower_bound=-5.0, scale=0.25, chunked=True)
    o, S = R.kda_core(
        x["q"],
        x["k"],
        x["v"],
        x["f"],
        x["b"],
        x["A_log"],
        x["dt_bias"],
        initial_state=S0,
        cu_seqlens=cu,
        **args,
    )
    for n in range(3):
        sl = slice(cu[n], cu[n + 1])
        o_n, S_n = R.kda_core(
            x["q"][sl],
            x["k"][sl],
            x["v"][sl],
            x["f"][sl],
            x["b"][sl],
            x["A_log"],
            x["dt_bias"],
            initial_state=S0[n : n + 1],
            cu_seqlens=[0, lens[n]],
            **args,
        )
        assert torch.equal(o[sl], o_n) and torch.equal(S[n], S_n[0])


def test_short_conv_matches_conv1d_and_continues_from_state():
    C, W, T = 12, 4, 11
    x, w = torch.randn(T, C), torch.randn(C, W)
    zero = torch.zeros(1, C, W - 1)
    y, state = R.short_conv(x, w, zero, [0, T])
    ref = F.silu(F.conv1d(x.t()[None], w[:, None, :], padding=W - 1, groups=C)[0, :, :T].t())
    torch.testing.assert_close(y, ref, rtol=0, atol=1e-6)
    assert torch.equal(state[0], x[-(W - 1) :].t())
    y1, s1 = R.short_conv(x[:6], w, zero, [0, 6])
    y2, s2 = R.short_conv(x[6:], w, s1, [0, T - 6])
    torch.testing.assert_close(torch.cat([y1, y2]), y, rtol=0, atol=1e-6)
    assert torch.equal(s2, state)
    y3, _ = R.short_conv(x[:2], w, zero, [0, 2])  # shorter than the kernel
    torch.testing.assert_close(y3, y[:2], rtol=0, atol=1e-6)


def test_gated_rms_norm_formula():
    o, z, w = torch.randn(5, 3, 8), torch.randn(5, 3, 8), torch.randn(8)
    ref = o / torch.sqrt(o.pow(2).mean(-1, keepdim=True) + 1e-5) * w * torch.sigmoid(z)
    torch.testing.assert_close(R.gated_rms_norm(o, z, w, 1e-5), ref)
