"""The routed-expert kernels (`k3kernels.moe`) against the fp32 torch reference.

Inputs are drawn once in fp32 from a fixed generator and cast to the tested dtype; the
reference reads the cast values in fp32, so the error measured is the path's own. Tolerances
come from `k3kernels.moe.TOLERANCES`. CPU (default suite): the torch path of `fused_experts`
(grouped GEMM, torch activation and combine) at tiny shapes, and the Triton kernels under
TRITON_INTERPRET=1 (tests/conftest.py sets it, before triton is imported, when there is no
GPU). GPU (`gpu`): K3-slice shapes (E 112, top-2, latent 3584, I 3072) at 8,192, 64 and 1
tokens, an expert-parallel half, bf16 and fp32, determinism, and no host sync in the whole
expert pass. The packed (MXFP4) experts' GEMMs: `test_w4a16.py`; shared inputs:
`moe_inputs.py`. Measured on an H200 (torch 2.11,
triton 3.6): T8192-prefill bf16 and fp32 and T64-decode bf16 pass; the remaining gpu cases have
not run on a GPU yet.
Old code: `Experts.forward` read the group counts with `.tolist()`, which
`test_moe_block_reads_nothing_on_the_host` catches.
"""


import pytest
import torch
from k3kernels.moe import TOLERANCES
from k3kernels.moe import reference as R
from k3kernels.moe.experts import fused_experts
from k3kernels.moe.grouped_gemm import grouped_mm, grouped_mm_loop
from k3kernels.moe.permute import sort_slots

from moe_inputs import DTYPES, K3_SLICE, KIMI_LINEAR, TINY, check_experts, inputs

from k3batch.testing import assert_close

def _check_act(M, I, act, dtype, device):
    """moe_act on fused rows (the experts', the dense FFN's and the shared experts')."""
    from k3kernels.moe import act as act_kernels
    from k3kernels.moe.act import moe_act

    g = torch.Generator().manual_seed(1)
    h = torch.randn(M, 2 * I, generator=g) * 3
    h[0] *= 30  # |g| past where exp(-g) overflows fp32: the quotients must still be right
    h = h.to(device=device, dtype=dtype)
    ref = R.gated_act_reference(h, act)
    rel, mx = TOLERANCES[("act", dtype)]
    out = moe_act(h, act)
    assert out.dtype == dtype
    assert_close(f"act_{act}", ref, out, rel_rms=rel, max_abs=mx)
    rows_in_pairs = act_kernels._launch(h[:, :I], h[:, I:], act, 4.0, 25.0, block_m=2)
    assert torch.equal(rows_in_pairs, out), "rows are independent: the tile must not matter"
    if I % 256 == 0:  # the Gluon W4A16 decode kernel's column order: the same values, moved
        from k3kernels.moe.interleave import interleave_reference

        assert torch.equal(moe_act(h, act, interleave=True), interleave_reference(out))


def _check_parts(device):
    """moe_act and moe_combine on K's fp32 partial products [parts, M, F] (the split Gluon
    W4A16 decode kernel's output) against the reference on their sum."""
    from k3kernels.moe.act import moe_act
    from k3kernels.moe.combine import moe_combine

    g = torch.Generator().manual_seed(4)
    h = (torch.randn(3, 6, 2 * 256, generator=g) * 2).to(device)
    rel, mx = TOLERANCES[("act", torch.bfloat16)]
    out = moe_act(h, "situ", out_dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16 and out.shape == (6, 256)
    assert_close("act_parts", R.gated_act_reference(h.sum(0), "situ"), out, rel_rms=rel,
                 max_abs=mx)  # fmt: skip
    ids = torch.randint(0, 4, (3, 2), generator=g)
    order = sort_slots(ids.to(device), 4)
    y = torch.randn(2, 6, 40, generator=g).to(device)
    w = (torch.rand(3, 2, generator=g) + 0.1).to(device)
    ref = R.combine_reference(y.sum(0), order.slot_pos_Tk, w, order.valid_Tk)
    out = moe_combine(y, order.slot_pos_Tk, w, order.valid_Tk)
    assert_close("combine_parts", ref, out, rel_rms=1e-6)


def _check_gather_interleaved(T, K, device):
    """Rows gathered (repeated, any order) and all rows, against index_select then the
    interleaving views."""
    from k3kernels.moe.interleave import gather_interleaved, interleave_reference

    g = torch.Generator().manual_seed(3)
    x = torch.randn(T, K, generator=g).to(device, torch.bfloat16)
    rows = torch.randint(0, T, (2 * T + 1,), generator=g).to(device)
    ref = interleave_reference(x.index_select(0, rows))
    assert torch.equal(gather_interleaved(x, rows), ref)
    assert torch.equal(gather_interleaved(x), interleave_reference(x))
    wide = torch.zeros(T, K + 8, dtype=x.dtype, device=device)
    wide[:, :K] = x  # a row stride past K
    assert torch.equal(gather_interleaved(wide[:, :K], rows), ref)
    with pytest.raises(ValueError, match="multiple of 256"):
        gather_interleaved(x[:, :128])


def _check_combine(T, k, D, dtype, device):
    from k3kernels.moe.combine import moe_combine

    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 5, (T, k), generator=g)
    order = sort_slots(ids.to(device), 4)  # expert 4 is not held here: those slots are invalid
    y = torch.randn(T * k, D, generator=g).to(device=device, dtype=dtype)
    y[order.slot_pos_Tk[~order.valid_Tk]] = float("nan")  # unwritten rows must never be read
    w = (torch.rand(T, k, generator=g) + 0.1).to(device)
    ref = R.combine_reference(y, order.slot_pos_Tk, w, order.valid_Tk)
    out = moe_combine(y, order.slot_pos_Tk, w, order.valid_Tk)
    rel, mx = TOLERANCES[("combine", dtype)]
    # cast and adds in the same pass: rounded as torch's (sum.to(dtype) + a0) + a1, so equal
    # to it given the same fp32 sum (the kernel's own, checked above). The interpreter rounds
    # fp32 to bf16 toward zero, the GPU to nearest even: within a bf16 step of each operand there.
    a0, a1 = (torch.randn(T, D, generator=g).to(device=device, dtype=dtype) for _ in range(2))
    a1 = a1 * 64  # the residual stream, larger: a wrong order or a missed rounding shows
    for adds in ((a0,), (a0, a1)):
        fused = moe_combine(y, order.slot_pos_Tk, w, order.valid_Tk, out_dtype=dtype, adds=adds)
        want, want_ref = out.to(dtype), ref.to(dtype)
        for a in adds:
            want, want_ref = want + a, want_ref + a
        assert fused.dtype == dtype
        if device == "cuda" or dtype == torch.float32:
            assert torch.equal(fused, want)
        else:
            scale = out.abs() + sum(a.float().abs() for a in adds) + want.float().abs()
            assert ((fused.float() - want.float()).abs() <= len(adds) * scale * 2**-7).all()
        assert torch.equal(R.combine_reference(y, order.slot_pos_Tk, w, order.valid_Tk,
                                               out_dtype=dtype, adds=adds), want_ref)
    with pytest.raises(ValueError, match="at most 2"):
        moe_combine(y, order.slot_pos_Tk, w, order.valid_Tk, out_dtype=dtype, adds=(a0,) * 3)
    return assert_close("combine", ref, out, rel_rms=rel, max_abs=mx)


def _check_grouped_mm_triton(device, act_too=True, **blocks):
    """The Triton grouped GEMM against the loop, fp32 and bf16, with empty groups (of 0, 3, 67
    and 70 rows: longer than one row tile, or with a second one of block_t rows) and unused rows
    at the end, and with the rows read by index; act_too: and the activation in the GEMM."""
    from k3kernels.moe.grouped_gemm_triton import grouped_mm_triton

    g = torch.Generator().manual_seed(4)
    x = torch.randn(150, 48, generator=g)
    w = torch.randn(5, 40, 48, generator=g) / 7
    offs = torch.tensor([3, 3, 70, 140, 140], dtype=torch.int32, device=device)
    ref = grouped_mm_loop(x, w, offs.cpu())[:140]
    # fp32 on a GPU: tl.dot runs as TF32 (10-bit mantissa, ~3e-4 rms over K 48).
    fp32_tol = 1e-5 if device == "cpu" else 2e-3
    for dtype, tol in ((torch.float32, fp32_tol), (torch.bfloat16, 1e-2)):
        xd, wd = x.to(device=device, dtype=dtype), w.to(device=device, dtype=dtype)
        out = grouped_mm_triton(xd, wd, offs, **blocks)[:140]
        ref_d = grouped_mm_loop(xd.float(), wd.float(), offs)[:140]  # the cast inputs, in fp32
        assert_close(f"grouped_mm_triton_{dtype}", ref_d, out, rel_rms=tol)
        # the rows read by index from a [T, K] x (repeated, any order): the same rows' bits
        rows = torch.randint(0, 61, (150,), generator=g).to(device)
        x_T = torch.randn(61, 48, generator=g).to(device=device, dtype=dtype)
        got = grouped_mm_triton(x_T, wd, offs, rows, **blocks)[:140]
        want = grouped_mm_triton(x_T.index_select(0, rows), wd, offs, **blocks)[:140]
        assert torch.equal(got, want), f"gathered rows, {dtype}"
        if not act_too:
            continue
        # the gated activation in the GEMM (40 rows: gate 0-19, up 20-39; each program's
        # column tile crosses I = 20 where block_n / 2 does not divide it) against the
        # reference's act of the same fp32 sums, and the rows by index with it
        for act in ("situ", "silu"):
            fused = grouped_mm_triton(xd, wd, offs, act=act, **blocks)[:140]
            assert fused.shape == (140, 20) and fused.dtype == dtype
            want = R.gated_act_reference(ref_d, act)
            assert_close(f"grouped_mm_triton_{act}_{dtype}", want, fused, rel_rms=tol)
            got = grouped_mm_triton(x_T, wd, offs, rows, act=act, **blocks)[:140]
            want = grouped_mm_triton(x_T.index_select(0, rows), wd, offs, act=act, **blocks)
            assert torch.equal(got, want[:140]), f"gathered rows, {act}, {dtype}"
    with pytest.raises(ValueError, match="act is one of"):
        grouped_mm_triton(xd, wd[:, :39].contiguous(), offs, act="silu", **blocks)
    return ref


def _check_many_experts(device):
    """37 experts (the kernels scan their tile counts over 64 lanes), most of them empty or
    of one row, with a grid at its bound: every row written, equal to the loop (fp32)."""
    from k3kernels.moe.grouped_gemm_triton import grouped_mm_triton

    g = torch.Generator().manual_seed(7)
    counts = torch.zeros(37, dtype=torch.int64)
    counts[torch.randperm(37, generator=g)[:9]] = torch.tensor([1, 1, 1, 2, 5, 16, 17, 33, 1])
    offs = torch.cumsum(counts, 0).to(torch.int32)
    x, w = torch.randn(80, 16, generator=g), torch.randn(37, 16, 16, generator=g)
    ref = grouped_mm_loop(x, w, offs)[: int(offs[-1])]
    out = grouped_mm_triton(x.to(device), w.to(device), offs.to(device), block_m=16, block_n=16,
                            block_k=16, num_warps=4, num_stages=2)[: int(offs[-1])]  # fmt: skip
    assert_close("grouped_mm_triton-37-experts", ref, out.cpu(), rel_rms=1e-5)


# ---- CPU, default suite --------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_grouped_mm_matches_loop(dtype):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(20, 32, generator=g).to(dtype)
    w = torch.randn(5, 48, 32, generator=g).to(dtype)
    offs = torch.tensor([3, 3, 10, 17, 17], dtype=torch.int32)  # empty groups; rows 17+ unused
    ref = grouped_mm_loop(x, w, offs)
    out = grouped_mm(x, w, offs)
    assert_close("grouped_mm", ref[:17].float(), out[:17].float(), rel_rms=1e-6)


def test_grouped_mm_rows_do_not_depend_on_their_group_size():
    """CPU: a row's product is the same bits alone in its group, in a group of 2 or 3, or in a
    large one (small groups are padded; see grouped_gemm's module doc)."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(12, 32, generator=g)
    w = torch.randn(4, 48, 32, generator=g)
    big = grouped_mm(x, w, torch.tensor([0, 0, 12, 12], dtype=torch.int32))  # all in expert 2
    for ends in ([1, 3, 6, 12], [2, 2, 5, 12], [0, 1, 4, 9]):  # groups of 1, 2, 3 rows
        offs = torch.tensor(ends, dtype=torch.int32)
        out = grouped_mm(x, w[[2, 2, 2, 2]], offs)  # every group is expert 2's weight
        assert torch.equal(out[: ends[-1]], big[: ends[-1]]), ends


@pytest.mark.parametrize("shape", TINY.values(), ids=TINY.keys())
def test_fused_experts_torch_path_matches_reference(shape):
    check_experts(shape, torch.float32, "cpu", use_triton=False)


def test_moe_block_reads_nothing_on_the_host(model_factory, monkeypatch):
    """The expert pass calls no Python-level host read (the old loop did `.tolist()`)."""
    moe = model_factory("k3-debug").model.layers["1"].block_sparse_moe
    x = torch.randn(9, moe.experts.w2.shape[1])
    ids = torch.randint(0, moe.experts.w2.shape[0], (9, 2))
    w = torch.rand(9, 2)

    def forbidden(*args, **kwargs):
        raise AssertionError("host read in the expert pass")

    for name in ("tolist", "item", "nonzero", "__bool__"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    with torch.no_grad():
        moe.experts(x, ids, w)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs on CPU")
def test_moe_triton_kernels_interpreted_on_cpu():
    """The Triton kernels at tiny shapes under TRITON_INTERPRET=1 (tests/conftest.py sets it
    when there is no GPU)."""
    _interpreted_checks()


def _interpreted_checks():
    for dtype in DTYPES.values():
        for act in ("situ", "silu"):
            _check_act(5, 40, act, dtype, "cpu")
        _check_act(3, 256, "situ", dtype, "cpu")
        _check_combine(7, 3, 40, dtype, "cpu")
    _check_gather_interleaved(5, 512, "cpu")
    _check_parts("cpu")
    for name in ("T33-D32-I24-E8-k2", "T33-D32-I24-E8-k2-ep4of8"):
        check_experts(TINY[name], torch.float32, "cpu", use_triton=True)
    _check_grouped_mm_triton("cpu", block_n=16, block_k=16)
    _check_grouped_mm_triton("cpu", act_too=False, block_m=16, block_t=0, block_n=16,
                             block_k=16)  # decode  # fmt: skip
    _check_many_experts("cpu")
    # tiles of 64 + 16 rows: the group of 3 runs the 16-row tile alone, those of 67 and 70 both
    # (their rows 64-66 and 64-69 in the second)
    _check_grouped_mm_triton("cpu", block_m=64, block_n=16, block_k=16, block_t=16)
    check_experts(TINY["T33-D32-I24-E8-k2-ep4of8"], torch.float32, "cpu", use_triton=True,
                  gemm_impl="triton")  # fmt: skip


@pytest.mark.parametrize("gather", [False, True], ids=["copied-rows", "gathered-rows"])
@pytest.mark.parametrize("act", [False, True], ids=["act-apart", "act-in-gemm"])
def test_fused_experts_folding_into_the_gemm_interpreted(monkeypatch, gather, act):
    """The pass with the gate-up GEMM reading its rows by index (a tuned launch's "gather")
    and applying the activation (its "act"), under the interpreter: the reference's result,
    with no index_select of x where it gathers and no [T k, 2 I] output where it activates."""
    from k3kernels.moe import grouped_gemm_triton as G

    shape, calls, gemm = TINY["T33-D32-I24-E8-k2-ep4of8"], [], G.grouped_mm_triton

    def spy(x, w, offs, rows_M=None, **config):
        out = gemm(x, w, offs, rows_M, **config)
        calls.append((x.shape[0], rows_M is not None, out.shape[1]))
        return out

    monkeypatch.setattr(G, "fusions", lambda *a: {"gather": gather, "act": act})
    monkeypatch.setattr(G, "grouped_mm_triton", spy)
    check_experts(shape, torch.float32, "cpu", use_triton=True, gemm_impl="triton")
    T, D, I, k = shape[0], shape[1], shape[2], shape[4]
    # x's rows (T by index, else the T k sorted), gate-up to 2 I or act to I; then the down GEMM
    first = (T if gather else T * k, gather, I if act else 2 * I)
    assert calls == [first, (T * k, False, D)]


# ---- GPU: K3-slice shapes ------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("shape", K3_SLICE.values(), ids=K3_SLICE.keys())
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_experts_matches_reference_gpu(shape, dtype):
    check_experts(shape, dtype, "cuda", use_triton=True)


@pytest.mark.parametrize("mxfp4", [False, True], ids=["bf16-experts", "mxfp4-experts"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("shape", KIMI_LINEAR.values(), ids=KIMI_LINEAR.keys())
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_experts_kimi_linear_shapes_gpu(shape, dtype, mxfp4):
    """Issue 54: Kimi Linear's routed experts (SwiGLU, 256 of width 1,024, top-8) through the
    kernels the model picks, bf16 and MXFP4-packed, against the fp32 reference."""
    if mxfp4 and dtype == torch.float32:
        pytest.skip("W4A16 multiplies bf16 rows")
    check_experts(shape, dtype, "cuda", use_triton=True, gemm_impl="auto", mxfp4=mxfp4,
                  act="silu")  # fmt: skip


FOLDS = {"act": {"gather": False, "act": True}, "gather-act": {"gather": True, "act": True},
         "gather": {"gather": True, "act": False}}


@pytest.mark.parametrize("fold", FOLDS.values(), ids=FOLDS.keys())
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_experts_folded_into_the_gemm_kimi_linear_gpu(monkeypatch, fold):
    """The tuned folds of the gate-up GEMM (rows read by index, the activation applied to its
    sums) at Kimi Linear's 8K prefill in bf16, on the launch its table gives, against the fp32
    reference: what a sweep may pick must be right before it is timed."""
    from k3kernels.moe import grouped_gemm_triton as G

    monkeypatch.setattr(G, "fusions", lambda *a: fold)
    check_experts(KIMI_LINEAR["kimi-T8192-prefill"], torch.bfloat16, "cuda", use_triton=True,
                  gemm_impl="triton", act="silu")  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_grouped_mm_triton_gpu():
    _check_grouped_mm_triton("cuda")
    _check_grouped_mm_triton("cuda", block_m=16, block_t=0, block_n=64, block_k=128,
                             num_stages=4)  # fmt: skip
    _check_grouped_mm_triton("cuda", block_m=64, block_n=64, block_k=64, block_t=16)
    for shape in ("T8192-prefill", "T64-decode"):
        check_experts(K3_SLICE[shape], torch.bfloat16, "cuda", use_triton=True,
                      gemm_impl="triton")  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_moe_act_combine_and_gather_gpu(dtype):
    for act in ("situ", "silu"):
        _check_act(16384, 3072, act, dtype, "cuda")
    _check_combine(8192, 2, 3584, dtype, "cuda")
    _check_gather_interleaved(64, 3584, "cuda")
    _check_parts("cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_experts_deterministic_and_sync_free_gpu():
    x, w13, w2, ids, w = inputs(K3_SLICE["T8192-prefill"], torch.bfloat16, "cuda")
    kw = dict(act="situ", use_triton=True)
    first = fused_experts(x, w13, w2, ids, w, **kw)  # compiles the kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        again = fused_experts(x, w13, w2, ids, w, **kw)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(first, again)


def test_decode_tiles_up_to_eight_slots_per_expert():
    """The routed experts take the Triton grouped GEMM's 16-row decode tiles while the batch
    has at most 8 slots per expert on average (a 256-token decode step of 112 experts top-2 has
    4.6), prefill tiles and torch's grouped GEMM beyond."""
    from k3kernels.moe.grouped_gemm_triton import DEFAULT_CONFIGS, launch_config, regime

    E = 112
    assert regime(8 * E, E) == "decode" and regime(8 * E + 1, E) == "prefill"
    assert launch_config(512, E) == DEFAULT_CONFIGS["decode"]  # CPU: no tuned table
    assert launch_config(16384, E)["block_m"] == DEFAULT_CONFIGS["prefill"]["block_m"]


def test_grouped_mm_triton_names_operands_tma_cannot_read():
    """The Triton grouped GEMM reads x and w through TMA descriptors: rows of 40 bytes (not a
    multiple of 16) or experts that are not one after the other get a clear error, not a wrong
    product; `tma_ready` says which tensors qualify (the routed experts pick torch's grouped
    GEMM for the others)."""
    from k3kernels.moe.grouped_gemm_triton import grouped_mm_triton, tma_ready

    offs = torch.tensor([3, 8], dtype=torch.int32)
    x, w = torch.randn(8, 20, dtype=torch.bfloat16), torch.randn(2, 16, 20, dtype=torch.bfloat16)
    assert not tma_ready(x) and not tma_ready(w)
    with pytest.raises(ValueError, match="TMA"):
        grouped_mm_triton(x, w, offs)
    every_other = torch.randn(4, 16, 24, dtype=torch.bfloat16)[::2]
    wide = torch.randn(8, 24, dtype=torch.bfloat16)
    assert tma_ready(wide[:, :8]) and tma_ready(every_other[0]) and not tma_ready(every_other)
    assert tma_ready(torch.randn(2, 16, 32)[..., :24])  # padded rows: 128-byte stride


def test_tile_slots_bound_every_grouping():
    """The grid's bound on row tiles (`num_tile_slots`, host integers) holds for any grouping,
    with equality when every row has its own expert: the programs past it would be the ones
    left without a tile, and rows of theirs unwritten."""
    from k3kernels.moe.grouped_gemm_triton import num_tile_slots

    g = torch.Generator().manual_seed(0)
    cases = ((8, 5, 16), (8, 200, 16), (112, 128, 16), (112, 16384, 128), (3, 64, 64))
    for E, M, block_m in cases:
        for _ in range(50):
            used = int(torch.randint(0, M + 1, (1,), generator=g))  # rows after offs[-1] unused
            ids = torch.randint(0, E, (used,), generator=g)
            counts = torch.bincount(ids, minlength=E)
            tiles = int(((counts + block_m - 1) // block_m).sum())
            assert tiles <= num_tile_slots(M, E, block_m), (E, M, block_m, counts.tolist())
    assert num_tile_slots(5, 8, 16) == 5  # five experts of one row each: five tiles
