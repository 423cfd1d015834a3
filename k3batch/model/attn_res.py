"""Block Attention Residuals (spec section 3): the stream state and the softmax mixing.

K3 keeps no residual stream. Each sublayer reads a per-token softmax mixture over the completed
block summaries (the bank, b_0 = the embedding) and the current block's partial sum; sublayer
outputs only accumulate into that partial sum. `Stream` is exactly what crosses a pipeline
stage boundary. Kimi Linear (no AttnRes) uses `Stream.partial` as its plain residual stream.
"""

from dataclasses import dataclass, field

import torch
from torch import nn

from k3kernels.attn_res import MAX_CANDIDATES
from k3kernels.attn_res.reference import attn_res_mix_reference


@dataclass
class Stream:
    """Per-token state between sublayers. bank: completed block summaries, each [T, D];
    partial: the current block's partial sum [T, D], or None right after a block boundary."""

    bank: list[torch.Tensor] = field(default_factory=list)
    partial: torch.Tensor | None = None


def attn_res_mix(candidates: list[torch.Tensor], query_D, norm_weight_D, eps: float):
    """softmax_j(<gamma * w, RMSNorm(V_j)>) weighted sum of the un-normalized candidates.

    candidates: n tensors [T, D]. fp32 scores, softmax and sum; returns the candidates' dtype.
    No temperature and no bias (spec section 3). CUDA: one fused Triton kernel
    (`k3kernels.attn_res.mix`); elsewhere the torch reference."""
    dtype = candidates[0].dtype
    fusable = len(candidates) <= MAX_CANDIDATES and all(c.dtype == dtype for c in candidates)
    if candidates[0].is_cuda and fusable:
        from k3kernels.attn_res.mix import attn_res_mix as fused  # needs triton

        return fused(candidates, query_D, norm_weight_D, eps)
    return attn_res_mix_reference(candidates, query_D, norm_weight_D, eps)


def mix(stream: Stream, proj: nn.Linear, norm: nn.Module):
    """One aggregation point: its pseudo-query is `proj.weight` [1, D] (a Linear(D, 1)) and its
    key norm `norm.weight` [D]. With an empty bank the partial sum itself is the input."""
    if not stream.bank:
        return stream.partial
    cands = stream.bank + ([stream.partial] if stream.partial is not None else [])
    return attn_res_mix(cands, proj.weight, norm.weight, norm.eps)
