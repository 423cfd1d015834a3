"""Torch reference of RMSNorm (HF KimiRMSNorm). Shape legend: D normalized width."""

import torch


def rms_norm_reference(x, weight_D, eps: float):
    """Normalize over the last dim in fp32, cast back to x's dtype, then scale by the weight."""
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return weight_D * y
