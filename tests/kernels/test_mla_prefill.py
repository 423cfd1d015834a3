"""The MLA prefill flash kernel (expanded form, varlen, causal with a cached prefix) against
the fp32 reference, and the model's MLA layer on its kernel path against its torch path.

CPU (default suite): tiny shapes under TRITON_INTERPRET=1, fp32. GPU (`gpu`): K3 shapes
(H=96, Dn=128, R=64, Dv=128), ragged sequences with and without cached prefixes, bf16 and fp32.
The keys and values are strided views of one kv_b_proj-shaped output and of the latent, as the
model passes them. Breaking it: drop the
`offset +` of `pos_q` in `mla_prefill_kernel` (prefix ignored by the mask) and these fail.
"""

import pytest
import torch
from mla_inputs import DEVICE

from k3batch.model.forward_batch import ForwardBatch
from k3batch.testing import assert_close, slot_batch, slot_cache
from k3kernels.mla import TOLERANCES
from k3kernels.mla import reference as ref
from k3kernels.mla.prefill import mla_prefill  # isort: skip


def _cu(lens):
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return out


def _prefill_case(new, cached, H, Dn, R, Dv, L, dtype, seed, **launch):
    g = torch.Generator().manual_seed(seed)
    k_lens = [c + n for c, n in zip(cached, new)]
    T, S = sum(new), sum(k_lens)
    q = torch.randn(T, H, Dn + R, generator=g).to(dtype)
    kv = torch.randn(S, H, Dn + Dv, generator=g).to(dtype)  # the kv_b_proj output
    latent = torch.randn(S, L + R, generator=g).to(dtype)  # k_rope = its last R dims
    scale = (Dn + R) ** -0.5
    cu_q, cu_k = _cu(new), _cu(k_lens)
    d = [t.to(DEVICE) for t in (q, kv, latent)]
    o = mla_prefill(
        d[0], d[1][..., :Dn], d[2][:, L:], d[1][..., Dn:],
        torch.tensor(cu_q, dtype=torch.int32, device=DEVICE),
        torch.tensor(cu_k, dtype=torch.int32, device=DEVICE),
        max_seqlen_q=max(new), scale=scale, **launch,
    )  # fmt: skip
    # the reference on the same device (fp32 matmuls without TF32, torch's default)
    o_ref = ref.mla_prefill(d[0], d[1][..., :Dn], d[2][:, L:], d[1][..., Dn:], cu_q, cu_k,
                            scale=scale)  # fmt: skip
    return o, o_ref.cpu()


def _check(dtype, o_ref, o):
    rel, mx = TOLERANCES[("prefill_o", dtype)]
    assert_close("prefill_o", o_ref, o.float().cpu(), rel_rms=rel, max_abs=mx)


@pytest.mark.parametrize(
    "new,cached",
    [
        pytest.param([5, 33, 1], [0, 0, 0], id="B3-fresh"),
        pytest.param([1, 17, 40], [7, 20, 0], id="B3-prefix-T1-T17-mixed"),
    ],
)
def test_mla_prefill_matches_reference(new, cached):
    o, o_ref = _prefill_case(new, cached, 3, 16, 8, 16, 32, torch.float32, 0,
                             block_m=16, block_n=16, num_warps=4, num_stages=1)  # fmt: skip
    _check(torch.float32, o_ref, o)


@pytest.mark.skipif(DEVICE == "cuda", reason="the interpreter check; the GPU has its own")
def test_mla_layer_kernel_path_matches_torch_path(model_factory):
    """k3-debug MLA layer through a paged cache: a chunked prefill (second chunk over a cached
    prefix, two sequences) then two decode steps, kernels (interpreted on CPU) vs the fp32
    torch path, same weights, separate caches."""
    model = model_factory("k3-debug")
    attn = model.model.layers["3"].self_attn
    cfg = model.config
    g = torch.Generator().manual_seed(5)
    caches = {
        b: slot_cache(cfg, [3], num_slots=2, max_seq_len=48, device=DEVICE, dtype=torch.float32,
                      page_size=4)
        for b in ("torch", "triton")
    }  # fmt: skip
    steps = [([9, 5], [0, 0]), ([6, 11], [9, 5]), ([1, 1], [15, 16]), ([1, 1], [16, 17])]
    try:
        for new, cached in steps:
            x = torch.randn(sum(new), cfg.hidden_size, generator=g).to(DEVICE)
            outs = {}
            for backend, cache in caches.items():
                attn.backend = backend
                batch = slot_batch(cache, new, cached, [0, 1])
                cache.bind(batch)
                with torch.no_grad():
                    outs[backend] = attn(x, batch)
            assert_close(f"mla layer {new}/{cached}", outs["torch"], outs["triton"], rel_rms=1e-5)
    finally:
        attn.backend = "auto"


def test_mla_prefill_needs_pages_for_a_prefix(model_factory):
    attn = model_factory("k3-debug").model.layers["3"].self_attn
    with pytest.raises(ValueError, match="mla_pages"):
        attn(torch.zeros(2, 64), ForwardBatch(seq_lens=[2], cached_lens=[3]))


# ---- GPU: K3 shapes ---------------------------------------------------------------------------
gpu = [pytest.mark.gpu, pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA")]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize(
    "new,cached",
    [
        pytest.param([2048, 1000, 1, 130, 64], [0] * 5, id="fresh-ragged", marks=gpu),
        pytest.param([1024, 333, 1, 2048], [3000, 77, 500, 0], id="prefix-ragged", marks=gpu),
    ],
)
def test_mla_prefill_k3_shapes(new, cached, dtype):
    o, o_ref = _prefill_case(new, cached, 96, 128, 64, 128, 512, dtype, 1)
    _check(dtype, o_ref, o)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("_", [pytest.param(0, marks=gpu)], ids=["gpu"])
def test_mla_prefill_kimi_linear_shapes(_, dtype):
    """Issue 54: Kimi Linear's MLA (32 heads, the same head widths as K3), one 8K prompt and a
    ragged batch with prefixes."""
    for new, cached in [([8192], [0]), ([1024, 333, 1, 2048], [3000, 77, 500, 0])]:
        o, o_ref = _prefill_case(new, cached, 32, 128, 64, 128, 512, dtype, 1)
        _check(dtype, o_ref, o)
