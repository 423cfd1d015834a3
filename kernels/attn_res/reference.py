"""fp32 torch reference of the AttnRes mixing: the oracle of `mix.attn_res_mix`.
Shape legend: n candidates, T tokens, D hidden."""

import torch


def attn_res_mix_reference(candidates: list[torch.Tensor], query_D, norm_weight_D, eps: float):
    """softmax_j(<gamma * w, RMSNorm(V_j)>) weighted sum of the un-normalized candidates.

    candidates: n tensors [T, D]. fp32 scores, softmax and sum; returns the candidates' dtype.
    No temperature and no bias (spec section 3)."""
    V = torch.stack(candidates).float()  # [n, T, D]
    r = torch.rsqrt(V.pow(2).mean(-1, keepdim=True) + eps)
    w = norm_weight_D.float() * query_D.float().reshape(-1)  # gamma and w only as a product
    score = (V * r * w).sum(-1)  # [n, T]
    alpha = torch.softmax(score, dim=0)
    return (alpha[..., None] * V).sum(0).to(candidates[0].dtype)
