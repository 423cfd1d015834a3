"""The W4A16 grouped GEMMs of packed MXFP4 experts against dequantize-then-matmul: the Triton
kernel (`k3kernels.moe.w4a16`) under TRITON_INTERPRET=1 on CPU and at K3 widths on the GPU, the
Gluon decode kernel (`k3kernels.moe.w4a16_decode`; no interpreter: GPU only, and compiled for
sm_90 on CPU by `test_sm90_compile.py`) whole and with K split, and the packed pass through
either. Dequantized MXFP4 values are exact, so only the output rounding differs.
"""

import pytest
import torch
from k3kernels.moe import reference as R
from moe_inputs import K3_SLICE, TINY, check_experts

from k3batch.testing import assert_close


def _check_grouped_mm_mxfp4(device, M=150, K=64, N=40, tol_bf16=5e-3, big=False, folds=True,
                            **blocks):  # fmt: skip
    """The W4A16 grouped GEMM against dequantize-then-matmul: fp32 and bf16 activations, empty
    groups, groups longer than one row tile, unused rows at the end; K = 48 has a partial last
    scale group. Dequantized MXFP4 values are exact, so only the output rounding differs.
    big: weights up to ~2^20, scales past `MAX_SMALL_SCALE` (the kernel's exact path). folds:
    also the rows read by index and the activation in the GEMM."""
    from k3kernels.moe.mxfp4 import MXFP4Weight, quantize_mxfp4
    from k3kernels.moe.reference import grouped_mm_mxfp4_reference
    from k3kernels.moe.w4a16 import grouped_mm_mxfp4

    g = torch.Generator().manual_seed(5)
    x = torch.randn(M, K, generator=g)
    E = 5
    # Scales vary per row and group (factors 2^-3 .. 2^3), as real experts' do.
    w = torch.randn(E, N, K, generator=g) * 2.0 ** torch.randint(-3, 4, (E, N, 1), generator=g)
    packed, scale = quantize_mxfp4(w * (2.0**20 if big else K**-0.5))
    wq = MXFP4Weight.from_checkpoint(packed.to(device), scale.to(device))
    assert wq.small_scales != big
    cut = M * 14 // 15
    offs = torch.tensor([3, 3, cut // 2, cut, cut], dtype=torch.int32, device=device)
    # fp32 on a GPU: tl.dot runs as TF32 (~3e-4 rms).
    fp32_tol = 1e-5 if device == "cpu" else 2e-3
    for dtype, tol in ((torch.float32, fp32_tol), (torch.bfloat16, tol_bf16)):
        xd = x.to(device=device, dtype=dtype)
        out = grouped_mm_mxfp4(xd, wq, offs, **blocks)[:cut]
        ref = grouped_mm_mxfp4_reference(xd, wq, offs)
        assert_close(f"grouped_mm_mxfp4_{dtype}", ref, out, rel_rms=tol)
        if not folds:
            continue
        # the rows read by index from a [T, K] x (repeated, any order): the same rows' bits
        rows = torch.randint(0, M // 3, (M,), generator=g).to(device)
        got = grouped_mm_mxfp4(xd[: M // 3], wq, offs, rows, **blocks)[:cut]
        assert torch.equal(got, grouped_mm_mxfp4(xd[rows], wq, offs, **blocks)[:cut]), dtype
        # the gated activation in the GEMM (gate rows 0 .. N/2 - 1, up rows N/2 ..), and with
        # the rows by index
        for act in ("situ", "silu"):
            fused = grouped_mm_mxfp4(xd, wq, offs, act=act, **blocks)[:cut]
            assert fused.shape == (cut, N // 2) and fused.dtype == dtype
            want = R.gated_act_reference(ref, act)
            assert_close(f"grouped_mm_mxfp4_{act}_{dtype}", want, fused, rel_rms=tol)
            got = grouped_mm_mxfp4(xd[: M // 3], wq, offs, rows, act=act, **blocks)[:cut]
            want = grouped_mm_mxfp4(xd[rows], wq, offs, act=act, **blocks)[:cut]
            assert torch.equal(got, want), (act, dtype)


# ---- CPU, default suite --------------------------------------------------------------------


def test_grouped_mm_mxfp4_reference_is_dequantize_then_matmul():
    """The oracle itself, against bf16 weights rounded through MXFP4 by hand."""
    from k3kernels.moe.mxfp4 import MXFP4Weight, dequantize_mxfp4, quantize_mxfp4
    from k3kernels.moe.reference import grouped_mm_mxfp4_reference

    g = torch.Generator().manual_seed(6)
    x, w = torch.randn(10, 64, generator=g), torch.randn(2, 8, 64, generator=g)
    packed, scale = quantize_mxfp4(w)
    wq = MXFP4Weight.from_checkpoint(packed, scale)
    offs = torch.tensor([4, 10], dtype=torch.int32)
    wd = dequantize_mxfp4(packed, scale)
    ref = torch.cat([x[:4] @ wd[0].t(), x[4:] @ wd[1].t()])
    assert torch.equal(grouped_mm_mxfp4_reference(x, wq, offs), ref)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs on CPU")
def test_w4a16_interpreted_on_cpu():
    """The Triton W4A16 kernel at tiny shapes under TRITON_INTERPRET=1, alone and in the packed
    pass."""
    # Wide tiles: the interpreter's time goes per operation, not per element. K = 48: one
    # partial K step holding a partial scale group; N = 40: a partial column block.
    # (the folds, slow under the interpreter, at two of the tiles)
    for K, bm in ((48, 16), (64, 64)):  # a partial scale group at decode tiles; prefill tiles
        _check_grouped_mm_mxfp4("cpu", K=K, block_m=bm, block_n=32, block_k=64, folds=K == 48)
    _check_grouped_mm_mxfp4("cpu", K=64, N=32, block_m=16, block_n=32, block_k=64,
                            folds=False)  # no overhang  # fmt: skip
    # an expert's last tile of at most 16 rows as a 16-row tile: the groups of 3, 67 (64 + 3)
    # and 70 (64 + 6) rows
    _check_grouped_mm_mxfp4("cpu", K=64, block_m=64, block_t=16, block_n=32, block_k=64)
    for name in ("T33-D32-I24-E8-k2", "T33-D32-I24-E8-k2-ep4of8"):
        check_experts(TINY[name], torch.float32, "cpu", use_triton=True, mxfp4=True,
                      gemm_impl="auto")  # fmt: skip


def test_decode_kernel_splits_k_only_for_a_few_tokens(monkeypatch):
    """`w4a16_decode.k_parts` on 132 SMs at k3-slice widths (112 experts, top-2): K in its
    512-input steps at one token (7 and 6 parts: 96 and 56 programs unsplit), the down GEMM
    alone at 2 and 4 tokens, nothing from 8 tokens on (where splitting was slower on the H200)."""
    from types import SimpleNamespace

    from k3kernels.moe import w4a16_decode as D

    monkeypatch.setattr(D, "_num_sms", lambda device: 132)
    w13, w2 = (SimpleNamespace(shape=(112, N, K), packed=SimpleNamespace(device="cuda"))
               for N, K in ((6144, 3584), (3584, 3072)))  # fmt: skip
    picks = {T: (D.k_parts(2 * T, w13), D.k_parts(2 * T, w2)) for T in (1, 2, 4, 8, 64, 256)}
    assert picks == {1: (7, 6), 2: (1, 6), 4: (1, 3), 8: (1, 1), 64: (1, 1), 256: (1, 1)}


# ---- GPU: K3 widths ------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_grouped_mm_mxfp4_gpu():
    """W4A16 against dequantize-then-matmul at K3 widths (rel RMS <= 2e-3 in bf16: only the
    output rounding differs), prefill and decode tiles; then the whole packed pass."""
    for K, N in ((3584, 6144), (3072, 3584)):
        _check_grouped_mm_mxfp4("cuda", M=300, K=K, N=N, tol_bf16=2e-3)
        _check_grouped_mm_mxfp4("cuda", M=40, K=K, N=N, tol_bf16=2e-3, block_m=16, block_n=64,
                                block_k=128, num_stages=4)  # fmt: skip
        _check_grouped_mm_mxfp4("cuda", M=40, K=K, N=N, tol_bf16=2e-3, big=True)
        # 128-row tiles, an expert's last one of at most 64 rows as a 64-row tile (groups of
        # 3, 137 and 140 rows)
        _check_grouped_mm_mxfp4("cuda", M=300, K=K, N=N, tol_bf16=2e-3, block_m=128,
                                block_t=64, block_n=128, block_k=128, num_warps=4,
                                num_stages=3)  # fmt: skip
    for shape in ("T8192-prefill", "T64-decode", "T1-decode", "T8192-ep2-rank1"):
        check_experts(K3_SLICE[shape], torch.bfloat16, "cuda", use_triton=True, mxfp4=True,
                      gemm_impl="auto")  # fmt: skip
    # at decode sizes "auto" is the Gluon kernel (`test_grouped_mm_mxfp4_decode_gpu`)
    check_experts(K3_SLICE["T64-decode"], torch.bfloat16, "cuda", use_triton=True, mxfp4=True,
                  gemm_impl="triton")  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_grouped_mm_mxfp4_decode_gpu():
    """The Gluon decode kernel against dequantize-then-matmul at K3 widths (rel RMS <= 2e-3 in
    bf16): groups empty, of 1-2 rows and over two 8-row tiles, unused rows at the end; the same
    bits on a second run; K split into parts (their fp32 sum); what it does not take (fp32,
    large scales) it declines."""
    from k3kernels.moe import w4a16_decode as D
    from k3kernels.moe.mxfp4 import MXFP4Weight, quantize_mxfp4
    from k3kernels.moe.reference import grouped_mm_mxfp4_reference

    g = torch.Generator().manual_seed(6)
    offs = torch.tensor([0, 2, 3, 21, 36], dtype=torch.int32, device="cuda")
    for K, N in ((3584, 6144), (3072, 3584)):
        w = torch.randn(5, N, K, generator=g) * 2.0 ** torch.randint(-3, 4, (5, N, 1), generator=g)
        wq = MXFP4Weight.from_checkpoint(*(t.cuda() for t in quantize_mxfp4(w * K**-0.5)))
        x = torch.randn(40, K, generator=g).to("cuda", torch.bfloat16)
        assert D.supported(x, wq)
        out = D.grouped_mm_mxfp4_decode(x, wq, offs)[:36]
        assert torch.equal(out, D.grouped_mm_mxfp4_decode(x, wq, offs)[:36])
        ref = grouped_mm_mxfp4_reference(x, wq, offs)
        assert_close("grouped_mm_mxfp4_decode", ref, out, rel_rms=2e-3)
        for parts in {d for d in (2, 3, K // 512) if K // 512 % d == 0}:  # 7; 2, 3, 6
            split = D.grouped_mm_mxfp4_decode(x, wq, offs, parts=parts)
            assert split.shape == (parts, 40, N) and split.dtype == torch.float32
            assert_close(f"decode_parts{parts}", ref, split.sum(0)[:36], rel_rms=2e-3)
        big = MXFP4Weight.from_checkpoint(*(t.cuda() for t in quantize_mxfp4(w * 2.0**20)))
        assert not (D.supported(x.float(), wq) or D.supported(x, big))
        if D._num_sms(x.device) == 132:  # an H100 or H200: one token (2 rows, 96 and 56
            # programs unsplit) splits K into its 512-input steps
            assert D.k_parts(2, wq) == K // 512


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_decode_pass_with_dependent_launch_gpu(monkeypatch):
    """The packed decode pass as the engine runs it (CUDA-graph replays, each kernel started
    early by programmatic dependent launch, `k3kernels.pdl`) gives the bits of the same pass run
    eagerly with every kernel serialized: 1 token (K split, parts summed downstream), 4 and 64
    tokens, and an expert-parallel rank that holds none of a token's experts. A kernel that
    read its input before the previous one finished would give other bits or the NaNs the
    outputs are filled with before each replay."""
    import k3kernels.pdl as pdl
    from k3kernels.moe.experts import fused_experts
    from k3kernels.moe.mxfp4 import MXFP4Weight, quantize_mxfp4
    from moe_inputs import inputs

    kw = dict(act="situ", beta=4.0, linear_beta=25.0)
    shape = K3_SLICE["T64-decode"]
    _, w13, w2, _, _ = inputs((1,) + shape[1:], torch.bfloat16, "cuda")
    w13, w2 = (MXFP4Weight.from_checkpoint(*quantize_mxfp4(t)) for t in (w13, w2))
    for T, first in ((1, 0), (4, 0), (64, 0), (4, 112)):
        x, _, _, ids, w = inputs((T,) + shape[1:], torch.bfloat16, "cuda", seed=T)
        runs = [(x, ids, w)] * 3  # three passes in one graph: each one's tail feeds the next
        monkeypatch.setattr(pdl, "ENABLED", False)
        want = [fused_experts(x, w13, w2, i, ww, first_expert=first, **kw) for x, i, ww in runs]
        torch.cuda.synchronize()
        monkeypatch.setattr(pdl, "ENABLED", True)
        outs = [torch.empty_like(o) for o in want]

        def step():
            for o, (x, i, ww) in zip(outs, runs):
                o.copy_(fused_experts(x, w13, w2, i, ww, first_expert=first, **kw))

        step()  # compiles the PDL variants outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        for _ in range(5):
            for o in outs:
                o.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            for o, ref in zip(outs, want):
                assert torch.equal(o, ref), (T, first)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs on CPU")
@pytest.mark.parametrize("act", [False, True], ids=["act-apart", "act-in-gemm"])
def test_packed_pass_folds_into_the_w4a16_gemm_interpreted(monkeypatch, act):
    """The packed pass as the W4A16 kernel's table may run it: its rows of x by index (the
    default) and the activation in the gate-up GEMM (a table's "act"), against the reference;
    the gate-up GEMM gets x's T rows and their indices, and returns I columns with the act."""
    from k3kernels.moe import grouped_gemm_triton as G
    from k3kernels.moe import w4a16

    shape, calls, gemm = TINY["T33-D32-I24-E8-k2-ep4of8"], [], w4a16.grouped_mm_mxfp4

    def spy(x, w, offs, rows_M=None, **kw):
        out = gemm(x, w, offs, rows_M, **kw)
        calls.append((x.shape[0], rows_M is not None, out.shape[1]))
        return out

    monkeypatch.setattr(G, "launch_config", lambda *a, **kw: {"act": act})
    monkeypatch.setattr(w4a16, "grouped_mm_mxfp4", spy)
    check_experts(shape, torch.float32, "cpu", use_triton=True, mxfp4=True, gemm_impl="triton")
    T, D, I = shape[0], shape[1], shape[2]
    assert calls[0] == (T, True, I if act else 2 * I) and calls[1][1:] == (False, D)
