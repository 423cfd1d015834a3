"""fp32 torch reference of the routed experts: the oracle of the kernels in this package.

Plain and slow on purpose: one loop over experts, every product in fp32. Any device.
Shape legend: T tokens, D expert input width (the latent width for K3), I expert width,
F = 2 I (gate rows then up rows), E experts, k top-k, M sorted token slots (T k).
"""

import torch


def route_reference(logits_TE, bias_E, top_k: int, renormalize: bool, scaling: float,
                    ids_Tk=None):
    """(ids [T, k] int64, weights [T, k] fp32): top-k of sigmoid(logits) + bias, or the given
    ids; weights from the unbiased scores, renormalized over the k when asked, times scaling."""
    scores = torch.sigmoid(logits_TE.float())
    if ids_Tk is None:
        ids_Tk = torch.topk(scores + bias_E.float(), top_k, dim=-1).indices
    w = scores.gather(-1, ids_Tk)
    if renormalize:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return ids_Tk, w * scaling


def gated_act_reference(h_MF, act: str, beta: float = 4.0, linear_beta: float = 25.0):
    """act(gate, up) of fused rows h [M, 2 I] (gate = first I columns, up = the last I), fp32
    [M, I] (see `gated_act_pair_reference`)."""
    g, u = h_MF.chunk(2, dim=-1)
    return gated_act_pair_reference(g, u, act, beta, linear_beta)


def gated_act_pair_reference(gate, up, act: str, beta: float = 4.0, linear_beta: float = 25.0):
    """fp32 act(gate, up) of two [..., I] tensors. SiTU (K3):
    beta tanh(g / beta) sigmoid(g) * linear_beta tanh(u / linear_beta); SwiGLU ("silu", Kimi
    Linear): silu(g) * u."""
    g, u = gate.float(), up.float()
    if act == "situ":
        up = linear_beta * torch.tanh(u / linear_beta)
        return beta * torch.tanh(g / beta) * torch.sigmoid(g) * up
    if act == "silu":
        return torch.nn.functional.silu(g) * u
    raise ValueError(f"unknown gated activation {act!r}; known: situ, silu")


def combine_reference(y_MD, slot_pos_Tk, weights_Tk, valid_Tk, *, out_dtype=torch.float32,
                      adds=()):  # fmt: skip
    """out[t] = sum over valid j of weights[t, j] * y[slot_pos[t, j]], fp32 [T, D], then cast
    to out_dtype and each of adds added in turn (in out_dtype)."""
    rows = y_MD.float()[slot_pos_Tk]  # [T, k, D]
    w = torch.where(valid_Tk, weights_Tk.float(), 0.0)
    out = (torch.where(valid_Tk[..., None], rows, 0.0) * w[..., None]).sum(1).to(out_dtype)
    for a in adds:
        out = out + a
    return out


def experts_reference(x_TD, w13_EFD, w2_EDI, ids_Tk, weights_Tk, *, act: str, beta: float = 4.0,
                      linear_beta: float = 25.0, first_expert: int = 0):  # fmt: skip
    """sum_j weights[t, j] * E_{ids[t, j]}(x[t]) in fp32 [T, D], with
    E_e(x) = w2[e] act(w13[e] x). The weights hold experts [first_expert, first_expert + E);
    slots routed to other experts contribute nothing (an expert-parallel rank's partial sum)."""
    x = x_TD.float()
    out = torch.zeros(x.shape[0], w2_EDI.shape[1], dtype=torch.float32, device=x.device)
    local_Tk = ids_Tk - first_expert
    for e in range(w13_EFD.shape[0]):
        tok, slot = (local_Tk == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        h = gated_act_reference(x[tok] @ w13_EFD[e].float().t(), act, beta, linear_beta)
        y = h @ w2_EDI[e].float().t()
        out.index_add_(0, tok, y * weights_Tk[tok, slot].float()[:, None])
    return out


def grouped_mm_mxfp4_reference(x_MK, w, offs_E):
    """The W4A16 grouped GEMM's oracle: MXFP4 weights `w` (`mxfp4.MXFP4Weight`) dequantized
    to fp32, then rows [offs[e-1], offs[e]) of x times expert e's weight, fp32 [offs[-1], N]."""
    from k3kernels.moe.mxfp4 import MXFP4Weight

    x = x_MK.float()
    out = torch.zeros(int(offs_E[-1]), w.packed.shape[1], dtype=torch.float32, device=x.device)
    start = 0
    for e, end in enumerate(offs_E.tolist()):
        if end > start:
            we = MXFP4Weight(w.packed[e], w.scale[e]).dequantize(torch.float32)
            out[start:end] = x[start:end] @ we.t()
        start = end
    return out
