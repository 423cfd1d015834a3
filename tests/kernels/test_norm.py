"""The fused RMSNorm kernel (`k3kernels.norm.rms_norm`) against its torch reference.

Rows drawn in fp32 with a spread of scales, cast to the tested dtype; the reference reads the
cast values in fp32 (fp32 output, so the kernel's own two roundings are what is measured).
Tolerances: `k3kernels.norm.TOLERANCES`. CPU (default suite): the kernel under
TRITON_INTERPRET=1 (set by tests/conftest.py without a GPU): D 40 (one block), D 40 with
16-wide blocks (the two-pass path), a [2, 3, D] input, a column-sliced (strided) input, and
with a residual added first (one and two passes).
GPU (`gpu`): K3 widths (7168 hidden, 3584 latent, 512 kv latent) at 8,192 rows.
"""


import pytest
import torch
from k3kernels.norm import TOLERANCES
from k3kernels.norm.reference import rms_norm_reference

from k3batch.testing import assert_close

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _check_norm(shape, dtype, device, block_d=8192, sliced=False, residual=False):
    from k3kernels.norm.rms_norm import rms_norm

    g = torch.Generator().manual_seed(0)
    D = shape[-1]
    x = torch.randn(*shape[:-1], D + 8 if sliced else D, generator=g)
    x = x * torch.rand(*shape[:-1], 1, generator=g).mul(4).add(0.1)
    x = x[..., :D] if sliced else x
    w = 1 + 0.1 * torch.randn(D, generator=g)
    xc, wc = x.to(device=device, dtype=dtype), w.to(device=device, dtype=dtype)
    if residual:  # (norm(x + r), x + r): the sum rounded as torch's add rounds it
        r = torch.randn(x.shape, generator=g).to(device=device, dtype=dtype)
        out, total = rms_norm(xc, wc, 1e-5, residual=r, block_d=block_d)
        want = xc + r
        if device == "cuda" or dtype == torch.float32:
            assert torch.equal(total, want)
        else:  # the interpreter rounds fp32 to bf16 toward zero, torch to nearest even
            step = (xc.float().abs() + r.float().abs()) * 2**-7
            assert ((total.float() - want.float()).abs() <= step).all()
        xc = total
    else:
        out = rms_norm(xc, wc, 1e-5, block_d=block_d)
    ref = rms_norm_reference(xc.float(), wc.float(), 1e-5)
    assert out.dtype == dtype and out.shape == tuple(shape)
    rel, mx = TOLERANCES[("rms_norm", dtype)]
    return assert_close(f"rms_norm_{list(shape)}", ref, out, rel_rms=rel, max_abs=mx)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs on CPU")
def test_rms_norm_kernel_interpreted_on_cpu():
    """The Triton kernels at tiny shapes under TRITON_INTERPRET=1 (tests/conftest.py sets it
    when there is no GPU)."""
    _interpreted_checks()


def _interpreted_checks():
    for dtype in DTYPES.values():
        _check_norm((5, 40), dtype, "cpu")
        _check_norm((5, 40), dtype, "cpu", block_d=16)
        _check_norm((2, 3, 40), dtype, "cpu")
        _check_norm((5, 40), dtype, "cpu", sliced=True)
        _check_norm((5, 40), dtype, "cpu", residual=True)
        _check_norm((5, 40), dtype, "cpu", block_d=16, residual=True)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("D", [7168, 3584, 512])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_rms_norm_matches_reference_gpu(D, dtype):
    _check_norm((8192, D), dtype, "cuda")
    _check_norm((1000, D), dtype, "cuda", block_d=1024)  # two-pass path
    _check_norm((8192, D), dtype, "cuda", residual=True)
    _check_norm((1000, D), dtype, "cuda", block_d=1024, residual=True)
