"""The fla (fla-core Triton) KDA ops against the fp32 torch reference, on CUDA.

Inputs are drawn once in fp32 on the CPU from a fixed generator, cast to the tested dtype for
the kernel, and the reference reads the cast values in fp32, so the error measured is the
kernels' own. Tolerances come from `k3kernels.kda.TOLERANCES`. Shapes: k3-debug heads
(H=2, K=16) and K3 heads (H=96, K=128), varlen batches with sequences of 1, 63, 64, 130 and
~1000 tokens, the K3 gate (lower_bound -5) and the Kimi Linear softplus gate (None).
The measured numbers are printed as a table at the end of the module and merged into the JSON
file named by K3_NUMCHECK_OUT, if set.
"""

import pytest
import torch
from k3kernels.kda import TOLERANCES
from k3kernels.kda import reference as R

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

# name -> (H, K, sequence lengths); the K3 batch is 2048 tokens in all.
SHAPES = {
    "k3debug": (2, 16, [1, 63, 64, 130, 1000]),
    "k3": (96, 128, [1, 63, 64, 130, 766, 1024]),
}
GATES = {"bounded": -5.0, "softplus": None}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


NUMBERS_TABLE = "kernels/kda_fla"  # rows of the `numbers` fixture (tests/conftest.py)


def _fla():
    from k3kernels.kda import fla

    return fla


def _cu(lens):
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return out


def _kda_inputs(lens, H, K, *, zero_state: bool, seed: int):
    """fp32 CPU tensors: q, k, v, f [T, H, K]; b [T, H]; A_log [H]; dt_bias [H*K]; h0 [N, H, K, K].
    A_log and dt_bias follow `init_random_` (decays per step in roughly [0.4, 1) when bounded)."""
    g = torch.Generator().manual_seed(seed)
    T, N = sum(lens), len(lens)

    def r(*shape):
        return torch.randn(*shape, generator=g)

    x = {name: r(T, H, K) for name in ("q", "k", "v", "f")} | {"b": r(T, H)}
    x["A_log"] = torch.rand(H, generator=g).mul(15).add(1).log()
    x["dt_bias"] = r(H * K) * 0.5 - 1.0
    x["h0"] = torch.zeros(N, H, K, K) if zero_state else r(N, H, K, K) * 0.5
    return x


def _split(x, dtype):
    """(kernel args on CUDA, reference args on CUDA in fp32 holding the same values)."""
    dev = "cuda"
    kern = {n: x[n].to(dev, dtype) for n in ("q", "k", "v", "f")}
    kern |= {n: x[n].to(dev) for n in ("b", "A_log", "dt_bias", "h0")}  # fp32, as the model
    ref = {n: t.float() for n, t in kern.items()}
    return kern, ref


def _core_kwargs(d, lower_bound, cu):
    args = (d["q"], d["k"], d["v"], d["f"], d["b"], d["A_log"], d["dt_bias"])
    K = d["q"].shape[-1]
    kw = {"lower_bound": lower_bound, "scale": K**-0.5, "initial_state": d["h0"], "cu_seqlens": cu}
    return args, kw


def _prefill_cases():
    for shape, (H, K, lens) in SHAPES.items():
        for gate in GATES:
            for dt in ("bf16", "fp32"):
                if dt == "fp32" and shape == "k3":
                    continue  # fp32 chunk_kda at K3 heads: compile time, not coverage
                for state in ("h0rand", "h0zero"):
                    cid = f"{shape}-H{H}-K{K}-T{sum(lens)}-N{len(lens)}-{gate}-{dt}-{state}"
                    yield pytest.param(shape, gate, dt, state, id=cid)


@pytest.mark.parametrize("shape,gate,dt,state", list(_prefill_cases()))
def test_kda_prefill_matches_reference(numbers, shape, gate, dt, state):
    H, K, lens = SHAPES[shape]
    dtype, lower_bound, cu = DTYPES[dt], GATES[gate], _cu(lens)
    x = _kda_inputs(lens, H, K, zero_state=state == "h0zero", seed=sum(lens) + H)
    kern, ref = _split(x, dtype)
    args, kw = _core_kwargs(kern, lower_bound, cu)
    o, S = _fla().kda_prefill(*args, **kw)
    rargs, rkw = _core_kwargs(ref, lower_bound, cu)
    o_ref, S_ref = R.kda_core(*rargs, **rkw, chunked=True)
    assert o.dtype == dtype and o.shape == o_ref.shape
    assert S.dtype == torch.float32 and S.shape == S_ref.shape
    tag = f"prefill/{shape}/{gate}/{dt}/{state}"
    numbers.check(
        f"{tag}/o",
        o_ref,
        o,
        rel_rms=TOLERANCES[("o", dtype)][0],
        max_abs=TOLERANCES[("o", dtype)][1],
    )
    numbers.check(
        f"{tag}/state",
        S_ref,
        S,
        rel_rms=TOLERANCES[("state", dtype)][0],
        max_abs=TOLERANCES[("state", dtype)][1],
    )




def _conv_inputs(lens, C, W, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(lens), C, generator=g).to(dtype)
    w = torch.randn(C, W, generator=g) * 0.5  # fp32, as the checkpoint
    state = torch.randn(len(lens), C, W - 1, generator=g).to(dtype)
    return x, w, state


# fp32 at K3 widths would only add autotuning time: the model runs bf16 there.
SMALL_FP32 = [
    pytest.param(shape, dt, id=f"{shape}-C{SHAPES[shape][0] * SHAPES[shape][1]}-{dt}")
    for shape in SHAPES
    for dt in DTYPES
    if not (shape == "k3" and dt == "fp32")
]


@pytest.mark.parametrize("shape,dt", SMALL_FP32)
def test_short_conv_prefill_matches_reference(numbers, shape, dt):
    H, K, lens = SHAPES[shape]
    dtype, cu = DTYPES[dt], _cu(lens)
    x, w, state = _conv_inputs(lens, H * K, 4, dtype, seed=H)
    # The reference runs on the CPU: cuDNN's fp32 conv may use TF32.
    y_ref, s_ref = R.short_conv(x, w, state, cu)
    y, s = _fla().short_conv(x.cuda(), w.cuda(), state.cuda(), cu)
    assert y.dtype == dtype and s.dtype == dtype and s.shape == s_ref.shape
    numbers.check(
        f"conv_prefill/{shape}-C{H * K}/{dt}/y", y_ref, y, rel_rms=TOLERANCES[("conv_y", dtype)][0]
    )
    assert torch.equal(s.cpu(), s_ref), "conv state must be an exact copy of the inputs"


@pytest.mark.parametrize("shape,dt", SMALL_FP32)
def test_short_conv_prefill_then_decode_equals_whole(numbers, shape, dt):
    """Prefill all but the last 3 tokens of each sequence, then 3 in-place decode steps on a
    pool of blocks: the outputs and the final state equal one conv over the whole sequences."""
    H, K, lens = SHAPES[shape]
    lens = [max(n, 4) for n in lens]
    dtype, C, num_decode = DTYPES[dt], H * K, 3
    x, w, state = _conv_inputs(lens, C, 4, dtype, seed=H + 1)
    cu = _cu(lens)
    y_ref, s_ref = R.short_conv(x, w, state, cu)
    fla = _fla()
    xd, wd = x.cuda(), w.cuda()
    head = [n - num_decode for n in lens]
    x_head = torch.cat([xd[cu[i] : cu[i] + head[i]] for i in range(len(lens))])
    y_head, s = fla.short_conv(x_head, wd, state.cuda(), _cu(head))
    ys = [y_head.split(head)]
    pool = torch.full((len(lens) + 2, *s.shape[1:]), 1e30, dtype=dtype, device="cuda")
    slots = torch.arange(len(lens), device="cuda") + 2  # blocks 0 and 1 stay poisoned
    pool[slots] = s
    for j in range(num_decode):
        x_step = torch.stack([xd[cu[i] + head[i] + j] for i in range(len(lens))])
        ys.append(fla.short_conv_decode_(x_step, wd, pool, slots).split(1))
    s = pool[slots]
    assert (pool[:2] == 1e30).all()
    y = torch.cat([torch.cat([part[i] for part in ys]) for i in range(len(lens))])
    numbers.check(
        f"conv_prefill+decode/{shape}-C{C}/{dt}/y",
        y_ref,
        y,
        rel_rms=TOLERANCES[("conv_y", dtype)][0],
    )
    assert torch.equal(s.cpu(), s_ref), "conv state after decode differs from the whole conv"


@pytest.mark.parametrize("shape,dt", SMALL_FP32)
def test_gated_rms_norm_matches_reference(numbers, shape, dt):
    H, K, lens = SHAPES[shape]
    dtype, T = DTYPES[dt], sum(lens)
    g = torch.Generator().manual_seed(H + 2)
    o = (torch.randn(T, H, K, generator=g) * 0.1).to(dtype)  # KDA outputs are small
    z = (torch.randn(T, H, K, generator=g) * 2).to(dtype)
    weight = (1 + 0.1 * torch.randn(K, generator=g)).to(dtype)
    y_ref = R.gated_rms_norm(o, z, weight, 1e-5)
    y = _fla().gated_rms_norm(o.cuda(), z.cuda(), weight.cuda(), 1e-5)
    assert y.dtype == dtype and y.shape == y_ref.shape
    numbers.check(
        f"gated_norm/{shape}-T{T}/{dt}/y", y_ref, y, rel_rms=TOLERANCES[("norm_y", dtype)][0]
    )
