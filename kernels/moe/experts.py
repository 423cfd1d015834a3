"""The routed-expert pass with no host sync: sort slots, gather, two grouped GEMMs, fused
activation, fp32 combine. The same function serves prefill and decode, the single-device
model, pipeline stages and expert-parallel ranks (`first_expert` and the local expert count).

Steps: `sort_slots` orders the T k token slots by expert (with Triton, the counting sorts of
`route.py`); the slots' input rows are gathered ([M, D], M = T k), or read by index in the next
GEMM where its tuned launch says so; one grouped GEMM with the fused gate-up weights w13
[E, 2 I, D] gives [M, 2 I] and `moe_act` [M, I], or the GEMM applies the activation itself
where its launch says so (`grouped_gemm_triton.fusions`); a grouped
GEMM with w2 [E, D, I] gives [M, D]; `moe_combine`
sums each token's k rows times its router weights in fp32 (and may cast the sum and add the
shared expert's output and the residual stream in the same pass). For the Gluon W4A16 decode
kernel the gather and `moe_act` write their rows in its column order (`k3kernels.moe.interleave`),
and where it splits K (one or two tokens) `moe_act` and `moe_combine` sum its fp32 parts. At
decode sizes the Triton and Gluon kernels are chained by programmatic dependent launch
(`k3kernels.pdl`); the gather stays a launch of its own so that the sort is two launches before
the GEMM, which reads the sort's group ends before its wait (folded into the sort's launch, that
read raced the sort on the H200: `benchmarks/kernels_h200.txt`, ninth session).
With `use_triton=False` the two elementwise steps run as plain torch (same math), which is the
CPU path of the model.
Shape legend: T tokens, D input width, I expert width, E local experts, k top-k, M = T k.
"""

from functools import partial

import torch

from k3kernels.moe.grouped_gemm import grouped_mm
from k3kernels.moe.mxfp4 import MXFP4Weight
from k3kernels.moe.permute import sort_slots
from k3kernels.moe.reference import combine_reference, gated_act_reference


def fused_experts(x_TD, w13_EFD, w2_EDI, ids_Tk, weights_Tk, *, act: str, beta: float = 4.0,
                  linear_beta: float = 25.0, first_expert: int = 0,
                  use_triton: bool | None = None, gemm_impl: str = "auto",
                  out_dtype=torch.float32, adds=()) -> torch.Tensor:  # fmt: skip
    """sum_j weights[t, j] * w2[e] act(w13[e] x[t]) over the slots j whose expert
    e = ids[t, j] - first_expert is held here (0 <= e < E); [T, D] in out_dtype (default
    fp32: the sum as accumulated), plus adds ([T, D] tensors of out_dtype, at most two: Kimi
    Linear's shared expert, then its residual stream) in order, rounded as
    `(sum.to(out_dtype) + a0) + a1` (one pass, in the combine).

    x [T, D] and the weights share a dtype, or the weights are `MXFP4Weight`s (packed experts);
    ids [T, k] global expert ids; weights [T, k].
    use_triton: the fused Triton activation and combine (default: on CUDA).
    gemm_impl, packed experts: "auto" (with use_triton the Gluon kernel `w4a16_decode` where it
    takes both GEMMs: decode sizes on sm_90; the Triton W4A16 kernel `w4a16` otherwise),
    "triton" (that kernel always) or "torch" (dequantized to x's dtype per call, then torch's
    grouped GEMM: the reference path, also taken without use_triton).
    gemm_impl, bf16 or fp32 experts: "torch" (`torch._grouped_mm`), "triton"
    (`grouped_gemm_triton`) or "auto": Triton
    on a CUDA GPU of compute capability 9 or more (TMA) at decode shapes
    (`grouped_gemm_triton.regime`) and for bf16 at prefill (one H200, k3-slice: 3.9 TB/s
    against 2.9 on the expert bytes at 64 tokens; 54-57% of the bf16 peak against 46-49% at
    8,192 on real activations),
    torch otherwise (fp32 prefill: fp32 GEMMs, not TF32).
    """
    if use_triton is None:
        use_triton = x_TD.is_cuda
    if gemm_impl not in GEMM_IMPLS:
        raise ValueError(f"unknown gemm_impl {gemm_impl!r}; known: {', '.join(GEMM_IMPLS)}")
    if isinstance(w13_EFD, MXFP4Weight) and (not use_triton or gemm_impl == "torch"):
        # the reference path
        w13_EFD, w2_EDI = w13_EFD.dequantize(x_TD.dtype), w2_EDI.dequantize(x_TD.dtype)
    gemm, interleave, fuse = pick_gemm(w13_EFD, w2_EDI, ids_Tk.numel(), x_TD, gemm_impl)
    T = x_TD.shape[0]
    if T == 0:
        return torch.zeros(0, w2_EDI.shape[1], dtype=out_dtype, device=x_TD.device)
    sort = sort_slots
    if use_triton:  # one launch (decode) or two, not a dozen
        from k3kernels.moe import route

        sort = route.sort_slots
    order = sort(ids_Tk, w13_EFD.shape[0], first_expert)
    if fuse["gather"]:  # the GEMM reads each slot's row of x itself
        x_MD, rows_M = x_TD, order.token_M
    elif interleave:  # the Gluon decode kernel's column order, written by the gather and act
        from k3kernels.moe.interleave import gather_interleaved

        x_MD, rows_M = gather_interleaved(x_TD, order.token_M), None
    else:
        x_MD, rows_M = x_TD.index_select(0, order.token_M), None
    gate_up = (x_MD, w13_EFD, order.offs_E) + (() if rows_M is None else (rows_M,))
    if fuse["act"]:  # the GEMM applies the activation to its sums: [M, I]
        h_MI = gemm(*gate_up, act=act, beta=beta, linear_beta=linear_beta)
    else:
        h_MF = gemm(*gate_up)
        if use_triton:
            from k3kernels.moe.act import moe_act

            h_MI = moe_act(h_MF, act, beta, linear_beta, interleave=interleave,
                           out_dtype=x_TD.dtype)  # fmt: skip
        else:
            h_MI = gated_act_reference(h_MF, act, beta, linear_beta).to(h_MF.dtype)
    y_MD = gemm(h_MI, w2_EDI, order.offs_E)
    if use_triton:
        from k3kernels.moe.combine import moe_combine

        return moe_combine(y_MD, order.slot_pos_Tk, weights_Tk, order.valid_Tk,
                           out_dtype=out_dtype, adds=adds)  # fmt: skip
    return combine_reference(y_MD, order.slot_pos_Tk, weights_Tk, order.valid_Tk,
                             out_dtype=out_dtype, adds=adds)  # fmt: skip


GEMM_IMPLS = ("auto", "torch", "triton")  # gemm_impl of `fused_experts`


NO_FUSION = {"gather": False, "act": False}


def pick_gemm(w13, w2, num_rows: int, x_TD, gemm_impl: str):
    """(the grouped GEMM of `fused_experts` for these weights, num_rows sorted rows of x's
    dtype and device and gemm_impl (known), whether it reads its rows interleaved, what the
    gate-up GEMM folds in: {"gather": it reads its rows of x by index, `gemm(x_TD, w13, offs,
    token_M)`; "act": it applies the activation, `gemm(..., act=...)`}, the Triton kernel's
    tuned choice, `grouped_gemm_triton.fusions`)."""
    if isinstance(w13, MXFP4Weight):  # "auto" or "triton" here
        from k3kernels.moe import w4a16_decode as G
        from k3kernels.moe.w4a16 import grouped_mm_mxfp4

        if gemm_impl == "auto" and all(G.supported(x_TD, w, num_rows) for w in (w13, w2)):
            return partial(G.grouped_mm_mxfp4_decode, interleaved=True, parts=None), True, \
                NO_FUSION  # fmt: skip
        from k3kernels.moe.grouped_gemm_triton import fusions

        E, F, D = w13.shape
        return grouped_mm_mxfp4, False, fusions(num_rows, E, F, D, x_TD.dtype, packed=True)
    if gemm_impl == "auto" and not x_TD.is_cuda:  # the CPU path imports no Triton module
        gemm_impl = "torch"
    if gemm_impl == "auto":
        from k3kernels.moe.grouped_gemm_triton import regime, tma_ready

        decode = regime(num_rows, w13.shape[0]) == "decode"
        hopper = torch.cuda.get_device_capability(w13.device) >= (9, 0)
        # TMA reads the weights and the rows of x (D or I wide, contiguous)
        tma = all(tma_ready(w) and w.shape[-1] * w.element_size() % 16 == 0 for w in (w13, w2))
        fast = hopper and tma and (decode or w13.dtype == torch.bfloat16)
        gemm_impl = "triton" if fast else "torch"
    if gemm_impl == "triton":
        from k3kernels.moe.grouped_gemm_triton import fusions, grouped_mm_triton

        E, F, D = w13.shape
        return grouped_mm_triton, False, fusions(num_rows, E, F, D, x_TD.dtype)
    return grouped_mm, False, NO_FUSION
