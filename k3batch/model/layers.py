"""Single-device building blocks: RMSNorm, the SiTU / SwiGLU gated activations and the gated FFN.

Shape legend: T packed tokens, D hidden, I FFN width.
"""

import torch
from torch import nn


def linear(in_size: int, out_size: int, dtype=None, device=None) -> nn.Linear:
    return nn.Linear(in_size, out_size, bias=False, dtype=dtype, device=device)


def rms_norm(x, weight, eps: float):
    """HF KimiRMSNorm: normalize in fp32, cast back to x's dtype, then scale by the weight."""
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return weight * y


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype=None, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device))

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


def gated_act(gate, up, act: str, beta: float = 4.0, linear_beta: float = 25.0):
    """SiTU (K3): [beta tanh(g/beta) sigmoid(g)] * [linear_beta tanh(u/linear_beta)];
    SwiGLU (Kimi Linear, act 'silu'): silu(g) * u. fp32 math, cast back to gate's dtype."""
    g, u = gate.float(), up.float()
    if act == "situ":
        out = (
            beta
            * torch.tanh(g / beta)
            * torch.sigmoid(g)
            * (linear_beta * torch.tanh(u / linear_beta))
        )
    else:
        out = torch.nn.functional.silu(g) * u
    return out.to(gate.dtype)


class GatedMLP(nn.Module):
    """down(act(gate(x), up(x))): the dense FFN of layer 0 and the shared experts."""

    def __init__(self, config, in_size: int, inter_size: int, dtype=None, device=None):
        super().__init__()
        self.act, self.beta, self.linear_beta = (
            config.hidden_act,
            config.situ_beta,
            config.situ_linear_beta,
        )
        self.gate_proj = linear(in_size, inter_size, dtype, device)
        self.up_proj = linear(in_size, inter_size, dtype, device)
        self.down_proj = linear(inter_size, in_size, dtype, device)

    def forward(self, x_TD):
        h = gated_act(
            self.gate_proj(x_TD), self.up_proj(x_TD), self.act, self.beta, self.linear_beta
        )
        return self.down_proj(h)
