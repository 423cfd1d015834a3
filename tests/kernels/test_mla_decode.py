"""The paged MLA decode kernel (absorbed form, split-K, LSE) and the LSE merge against the fp32
references of `k3kernels.mla.reference`, including the DCP merge of per-rank partials.

CPU (default suite): tiny shapes under TRITON_INTERPRET=1, fp32 only (the interpreter does
not compute bf16 dots). GPU (`gpu`): K3 shapes (H=96, L=512, R=64, 64-token pages), ragged
lengths, bf16 and fp32. Page tables are
shuffled and everything a kernel must not read is NaN, so a wrong page, a read past a
sequence's end or a missed mask shows as a non-finite output. Breaking it: drop `& r_ok` or
use `pos` instead of `pos % PAGE` (or `n0` instead of `n0 % PAGE`) in `mla_decode_kernel`
and these fail; drop the rescaling
of the denominator and the rising many-block case fails.
"""

import pytest
import torch
from k3kernels.mla import TOLERANCES
from k3kernels.mla import reference as ref

from mla_inputs import DEVICE, paged_latents

from k3batch.testing import assert_close
from k3kernels.mla.decode import mla_decode, num_splits_for  # isort: skip
from k3kernels.mla.merge import merge_lse  # isort: skip


def _check(name, dtype, ref_t, out):
    rel, mx = TOLERANCES[(name, dtype)]
    assert_close(name, ref_t, out.float().cpu(), rel_rms=rel, max_abs=mx)


def _decode_case(lens, H, L, R, page_size, dtype, seed, num_splits, ramp=0.0):
    pool, rows, tokens = paged_latents(lens, L + R, page_size=page_size, dtype=dtype, seed=seed,
                                       ramp=ramp)  # fmt: skip
    g = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(len(lens), H, L + R, generator=g).to(dtype)
    scale = (128 + R) ** -0.5
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    o, lse = mla_decode(
        q.to(DEVICE), pool, rows, seq_lens, kv_lora=L, scale=scale, num_splits=num_splits
    )
    dense = torch.nn.utils.rnn.pad_sequence(tokens, batch_first=True) if lens else None
    mask = torch.arange(max(lens))[None, :] >= torch.tensor(lens)[:, None]
    o_ref, lse_ref = ref.partial_attention(q.float(), dense, mask, kv_lora=L, scale=scale)
    return (o, lse), (o_ref, lse_ref)


CPU_CASES = [
    pytest.param([1, 6, 17, 9], 2, 1, id="B4-H2-ragged-split1"),
    pytest.param([1, 6, 17, 9], 2, 3, id="B4-H2-ragged-split3"),
    pytest.param([23, 2, 0], 5, 4, id="B3-H5-empty-seq-split4"),
    pytest.param([3, 70], 20, 2, id="B2-H20-64-head-block-split2"),  # launch_config(H > 16)
    pytest.param([200, 90], 2, 1, id="B2-H2-many-blocks"),  # 7 token blocks in one program
]


@pytest.mark.parametrize("lens,H,splits", CPU_CASES)
@pytest.mark.parametrize("ramp", [0.0, 0.5], ids=["", "rising"])
def test_mla_decode_matches_reference(lens, H, splits, ramp):
    """rising: scores grow along the sequence, so the running max moves in block after block
    of a program (acc and denominator rescaled each time), not only in its first."""
    (o, lse), (o_ref, lse_ref) = _decode_case(lens, H, 32, 8, 4, torch.float32, 0, splits, ramp)
    _check("decode_o", torch.float32, o_ref, o)
    empty = torch.tensor(lens) == 0
    assert torch.isneginf(lse.cpu()[empty]).all() and (o.cpu()[empty] == 0).all()
    _check("decode_lse", torch.float32, lse_ref[~empty], lse.cpu()[~empty])


@pytest.mark.parametrize("page_size,splits", [(64, 2), (128, 3)], ids=["page64", "page128"])
@pytest.mark.parametrize("H", [2, 20], ids=["H2", "H20-split-scores"])
def test_mla_decode_tiles_within_one_page(page_size, splits, H):
    """Pages a multiple of the token tile (K3's 64-token pages): one page row per tile. H20:
    the two-warpgroup loop (`_split_scores_loop`), whose first tile lies before the split."""
    (o, lse), (o_ref, lse_ref) = _decode_case([70, 3, 129], H, 32, 8, page_size,
                                              torch.float32, 1, splits)  # fmt: skip
    _check("decode_o", torch.float32, o_ref, o)
    _check("decode_lse", torch.float32, lse_ref, lse.cpu())


def _stripe(tokens, M, d):
    return [t[d::M] for t in tokens]


def _dcp_merge_case(lens, M, H, L, R, page_size, dtype, seed):
    """M ranks each hold the stripe i % M == d of every sequence in their own shuffled pages;
    each runs the decode kernel (fp32 partials) and the merge kernel combines them: equal to
    the reference over the whole sequence."""
    g = torch.Generator().manual_seed(seed)
    full = [torch.randn(n, L + R, generator=g).to(dtype).float() for n in lens]
    q = torch.randn(len(lens), H, L + R, generator=g).to(dtype)
    scale = (128 + R) ** -0.5
    outs, lses = [], []
    for d in range(M):
        local = _stripe(full, M, d)
        local_lens = [t.shape[0] for t in local]
        pool, rows, _ = paged_latents(local_lens, L + R, page_size=page_size, dtype=dtype,
                                      seed=seed + 10 + d)  # fmt: skip
        pc = pool.cpu()  # write the stripe's exact values into the shuffled pages
        rc = rows.cpu()
        for b, t in enumerate(local):
            for i in range(t.shape[0]):
                pc[rc[b, i // page_size], i % page_size] = t[i].to(dtype)
        seq_lens = torch.tensor(local_lens, dtype=torch.int32, device=DEVICE)
        o, lse = mla_decode(q.to(DEVICE), pc.to(DEVICE), rows, seq_lens, kv_lora=L, scale=scale,
                            num_splits=2, out_dtype=torch.float32)  # fmt: skip
        outs.append(o)
        lses.append(lse)
    o, lse = merge_lse(torch.stack(outs), torch.stack(lses))
    dense = torch.nn.utils.rnn.pad_sequence(full, batch_first=True)
    mask = torch.arange(max(lens))[None, :] >= torch.tensor(lens)[:, None]
    o_ref, lse_ref = ref.partial_attention(q.float(), dense, mask, kv_lora=L, scale=scale)
    return (o, lse), (o_ref, lse_ref)


def test_mla_dcp_merge_through_kernel_matches_reference():
    (o, lse), (o_ref, lse_ref) = _dcp_merge_case([1, 2, 9, 14], 3, 2, 32, 8, 4, torch.float32, 0)
    _check("decode_o", torch.float32, o_ref, o)
    _check("decode_lse", torch.float32, lse_ref, lse)


def test_merge_kernel_matches_reference_merge():
    g = torch.Generator().manual_seed(3)
    parts, lses = torch.randn(3, 4, 2, 40, generator=g), torch.randn(3, 4, 2, generator=g) * 4
    lses[1, 0] = -torch.inf  # an empty partial
    lses[:, 2, 1] = -torch.inf  # a row where every partial is empty: lse -inf
    o, lse = merge_lse(parts.to(DEVICE), lses.to(DEVICE))
    o_ref, lse_ref = ref.merge_lse(parts, lses)
    _check("merge_o", torch.float32, o_ref, o)
    assert torch.equal(torch.isneginf(lse.cpu()), torch.isneginf(lse_ref))
    fin = torch.isfinite(lse_ref)
    _check("merge_lse", torch.float32, lse_ref[fin], lse.cpu()[fin])
    # as the DCP step calls it: strided views into one packed [N, B, H, L + 1] tensor
    packed = torch.cat([parts, lses[..., None]], dim=-1).to(DEVICE)
    o2, lse2 = merge_lse(packed[..., :40], packed[..., 40])
    assert torch.equal(o2.cpu(), o.cpu()) and torch.equal(lse2.cpu(), lse.cpu())


def test_num_splits_fills_the_device_without_tiny_splits():
    assert num_splits_for(64, 96, 8192) == 3  # 192 programs of 32 heads -> ~4 per SM
    assert num_splits_for(1, 96, 8192) == 16  # 3 programs: split the sequence (at most 16)
    assert num_splits_for(1, 96, 300) == 2  # but keep >= 256 tokens per split
    assert num_splits_for(256, 96, 8192) == 1
    assert num_splits_for(64, 12, 8192) == 4  # a TP8 rank: 64 programs -> 4 whole waves of 2


# ---- GPU: K3 shapes ---------------------------------------------------------------------------
gpu = [pytest.mark.gpu, pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA")]
K3_LENS = [1, 63, 64, 65, 1000, 4097, 2500, 7]  # ragged, page edges, one long


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("H", [96, 16, 32], ids=["H96", "H16-tp6", "H32-kimi-linear"])
@pytest.mark.parametrize("_", [pytest.param(0, marks=gpu)], ids=["gpu"])
def test_mla_decode_k3_shapes(_, H, splits, dtype):
    (o, lse), (o_ref, lse_ref) = _decode_case(K3_LENS, H, 512, 64, 64, dtype, 1, splits)
    _check("decode_o", dtype, o_ref, o)
    _check("decode_lse", dtype, lse_ref, lse)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("_", [pytest.param(0, marks=gpu)], ids=["gpu"])
def test_mla_dcp_merge_k3_shapes(_, dtype):
    (o, lse), (o_ref, lse_ref) = _dcp_merge_case([5, 700, 3000, 64], 4, 96, 512, 64, 64, dtype, 2)
    _check("decode_o", dtype, o_ref, o)
    _check("decode_lse", dtype, lse_ref, lse)
