"""Single-device building blocks: RMSNorm, the SiTU / SwiGLU gated activations and the gated FFN.
On CUDA the norm and the activation run as fused Triton kernels (`k3kernels.norm`,
`k3kernels.moe.act`); elsewhere as their torch references, the same math.

Shape legend: T packed tokens, D hidden, I FFN width.
"""

import torch
from torch import nn

from k3kernels.moe.reference import gated_act_pair_reference
from k3kernels.norm.reference import rms_norm_reference


def linear(in_size: int, out_size: int, dtype=None, device=None) -> nn.Linear:
    return nn.Linear(in_size, out_size, bias=False, dtype=dtype, device=device)


def rms_norm(x, weight, eps: float):
    """HF KimiRMSNorm: normalize in fp32, cast back to x's dtype, then scale by the weight.
    CUDA: one Triton kernel (`k3kernels.norm`); elsewhere the torch reference."""
    if x.is_cuda and weight.dtype == x.dtype:
        from k3kernels.norm.rms_norm import rms_norm as fused  # needs triton

        return fused(x, weight, eps)
    return rms_norm_reference(x, weight, eps)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype=None, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device))

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


def gated_act(gate, up, act: str, beta: float = 4.0, linear_beta: float = 25.0):
    """SiTU (K3): [beta tanh(g/beta) sigmoid(g)] * [linear_beta tanh(u/linear_beta)];
    SwiGLU (Kimi Linear, act 'silu'): silu(g) * u. fp32 math, cast back to gate's dtype.
    CUDA: one fused Triton kernel (`k3kernels.moe.act`); elsewhere plain torch."""
    if gate.is_cuda and gate.dtype == up.dtype:
        from k3kernels.moe.act import gated_act as fused  # needs triton

        return fused(gate, up, act, beta, linear_beta)
    return gated_act_pair_reference(gate, up, act, beta, linear_beta).to(gate.dtype)


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
