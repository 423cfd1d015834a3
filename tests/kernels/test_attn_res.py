"""The fused AttnRes mixing kernel (`k3kernels.attn_res.mix`) against the fp32 reference.

Candidates, query and norm weight are drawn in fp32 with different scales per candidate (so the
softmax is not flat), cast to the tested dtype; the reference reads the cast values in fp32.
Tolerances: `k3kernels.attn_res.TOLERANCES`. CPU (default suite): the kernel under
TRITON_INTERPRET=1 (set by tests/conftest.py without a GPU) at tiny, odd shapes (D 40,
1 to 10 candidates, T 1 and 5). GPU (`gpu`): K3 width D 7168 at 8,192 tokens, 2 and 10
candidates, and the model's `attn_res_mix` dispatching to the kernel.
"""


import pytest
import torch
from k3kernels.attn_res import TOLERANCES
from k3kernels.attn_res.reference import attn_res_mix_reference

from k3batch.testing import assert_close

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _inputs(n, T, D, dtype, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)  # on the device: 10 x 8192 x 7168

    def randn(*size):
        return torch.randn(*size, generator=g, device=device)

    cands = [randn(T, D) * (1 + j) for j in range(n)]
    query = randn(1, D) / D**0.5 * 4
    gamma = 1 + 0.1 * randn(D)
    return [c.to(dtype) for c in cands], query.to(dtype), gamma.to(dtype)


def _check_mix(n, T, D, dtype, device, mix_fn=None):
    if mix_fn is None:
        from k3kernels.attn_res.mix import attn_res_mix as mix_fn
    cands, q, gamma = _inputs(n, T, D, dtype, device)
    ref = attn_res_mix_reference([c.float() for c in cands], q.float(), gamma.float(), 1e-5)
    out = mix_fn(cands, q, gamma, 1e-5)
    assert out.dtype == dtype and out.shape == (T, D)
    rel, mx = TOLERANCES[("mix", dtype)]
    return assert_close(f"attn_res_mix_n{n}", ref, out, rel_rms=rel, max_abs=mx)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs on CPU")
def test_attn_res_kernel_interpreted_on_cpu():
    """The Triton kernels at tiny shapes under TRITON_INTERPRET=1 (tests/conftest.py sets it
    when there is no GPU)."""
    _interpreted_checks()


def _interpreted_checks():
    for dtype in DTYPES.values():
        for n, T in ((1, 5), (2, 5), (3, 1), (10, 5)):
            _check_mix(n, T, 40, dtype, "cpu")
    from k3kernels.attn_res.mix import attn_res_mix

    with pytest.raises(ValueError, match="candidates"):
        attn_res_mix([torch.zeros(2, 8)] * 17, torch.zeros(1, 8), torch.ones(8), 1e-5)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("n", [2, 10], ids=["n2", "n10"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_attn_res_mix_matches_reference_gpu(n, dtype):
    _check_mix(n, 8192, 7168, dtype, "cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_model_attn_res_mix_uses_the_kernel_gpu():
    from k3batch.model.attn_res import attn_res_mix

    _check_mix(3, 1000, 7168, torch.bfloat16, "cuda", mix_fn=attn_res_mix)
