"""Single-device building blocks: RMSNorm, the SiTU / SwiGLU gated activation, the gated FFN and
`FusedRows`, which runs the projections that read one input as one GEMM.
On CUDA the norm and the activation run as fused Triton kernels (`k3kernels.norm`,
`k3kernels.moe.act`); elsewhere as their torch references, the same math.

Shape legend: T packed tokens, D hidden, I FFN width, N output rows of a weight.
"""

import torch
import torch.nn.functional as F
from torch import nn

from k3kernels.moe.reference import gated_act_reference
from k3kernels.norm.reference import rms_norm_reference


def linear(in_size: int, out_size: int, dtype=None, device=None) -> nn.Linear:
    return nn.Linear(in_size, out_size, bias=False, dtype=dtype, device=device)


class FusedRows:
    """The `weight`s of sibling modules (`parent.<name>` for each name, in order) held as the
    row blocks of one tensor, so that one GEMM (or one conv launch) computes all their outputs.
    The members are bias-free maps of their weight alone (`nn.Linear(bias=False)`, or convs
    whose weight the caller applies), read by the caller through `weight()` or `linear()`.

    No second copy: each parameter's `.data` is re-pointed at its row block (a view), so
    parameter names, the state_dict, TP sharding by name and the planner's counts see the same
    parameters as before, and what writes a parameter in place (the loaders' `copy_`,
    `load_state_dict`) writes the fused tensor. `weight()` first checks, on the host only (dict
    lookups and data_ptr: no device sync, no allocation), that each parameter is still the
    object it re-pointed and still points at its block (the fused tensor is alive, so an address
    inside it can only be that view); a parameter replaced or moved since (`setattr`,
    `loader.allocate_`, `Module.to`, `load_state_dict(assign=True)`) makes it rebuild the fused
    tensor from the current values (one `torch.cat`; until then the old one stays allocated).
    So the first forward after a load rebuilds, holding one group's weights twice for a moment;
    on CUDA the separate blocks it frees stay in the allocator's cache until `empty_cache()`
    (which `engine.runner.measure_workspace` calls after its forward, before the arena is
    sized). Between rebuilds the tensor is the same, so a CUDA graph captured after an eager
    forward replays on it; a rebuild during a capture raises. Not a Module: it registers
    nothing.
    """

    def __init__(self, parent: nn.Module, names: tuple[str, ...]):
        self.parent, self.names = parent, tuple(names)
        self._fused = None
        self._members = ()  # (name, parameter, data_ptr) per name, as last re-pointed

    def weight(self) -> torch.Tensor:
        """[sum N_i, ...]: the members' weights stacked along dim 0, in `names` order."""
        if not self._is_current():
            self._rebuild()
        return self._fused

    def linear(self, x):
        """One GEMM for every member: x [..., in] -> [..., sum N_i], the members' outputs side
        by side in `names` order."""
        return F.linear(x, self.weight())

    def _param(self, name: str) -> nn.Parameter:
        return self.parent._modules[name]._parameters["weight"]

    def _is_current(self) -> bool:
        modules = self.parent._modules  # the dicts nn.Module's getattr reads, minus its overhead
        for name, p, ptr in self._members:
            if modules[name]._parameters["weight"] is not p or p.data_ptr() != ptr:
                return False
        return bool(self._members)

    def _rebuild(self) -> None:
        if any(getattr(self.parent._modules[n], "bias", None) is not None for n in self.names):
            raise ValueError(f"{self.names}: a fused member has a bias, which the GEMM would skip")
        params = [self._param(n) for n in self.names]
        kinds = {(p.dtype, p.device, p.shape[1:]) for p in params}
        if len(kinds) != 1:
            raise ValueError(f"{self.names} cannot share one weight: dtype, device and trailing "
                             f"shape differ: {sorted(map(str, kinds))}")  # fmt: skip
        if params[0].is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"fused weight of {self.names} rebuilt inside a CUDA graph "
                               f"capture: run one eager forward after loading weights")  # fmt: skip
        # A normal tensor even when built inside inference_mode: it serves forwards outside
        # it too (an inference tensor cannot be saved for backward nor updated in place there).
        with torch.inference_mode(False), torch.no_grad():
            fused = torch.cat([p.detach() for p in params])
            members, row = [], 0
            for name, p in zip(self.names, params):
                p.data = fused[row : row + p.shape[0]]
                row += p.shape[0]
                members.append((name, p, p.data_ptr()))
        self._fused, self._members = fused, tuple(members)


def rms_norm(x, weight, eps: float, residual=None):
    """HF KimiRMSNorm: normalize in fp32, cast back to x's dtype, then scale by the weight.
    With residual: (norm(s), s) for s = x + residual, the pre-norm residual step.
    CUDA: one Triton kernel (`k3kernels.norm`); elsewhere the torch reference."""
    if x.is_cuda and weight.dtype == x.dtype:
        from k3kernels.norm.rms_norm import rms_norm as fused  # needs triton

        return fused(x, weight, eps, residual=residual)
    if residual is None:
        return rms_norm_reference(x, weight, eps)
    s = x + residual
    return rms_norm_reference(s, weight, eps), s


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype=None, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device))

    def forward(self, x, residual=None):
        """norm(x), or (norm(x + residual), x + residual) in one pass on CUDA."""
        return rms_norm(x, self.weight, self.eps, residual)


def gated_act(h, act: str, beta: float = 4.0, linear_beta: float = 25.0):
    """act(gate, up) of h [..., 2 I] (gate columns [0, I), up [I, 2 I)) -> [..., I] in h's dtype.
    SiTU (K3): [beta tanh(g/beta) sigmoid(g)] * [linear_beta tanh(u/linear_beta)];
    SwiGLU (Kimi Linear, act 'silu'): silu(g) * u. fp32 math.
    CUDA: one fused Triton kernel (`k3kernels.moe.act.moe_act`); elsewhere plain torch."""
    if h.is_cuda:
        from k3kernels.moe.act import moe_act  # needs triton

        rows = h.reshape(-1, h.shape[-1])  # 3-d input would read as moe_act's split-K parts
        return moe_act(rows, act, beta, linear_beta).view(*h.shape[:-1], -1)
    return gated_act_reference(h, act, beta, linear_beta).to(h.dtype)


class GatedMLP(nn.Module):
    """down(act(gate(x), up(x))): the dense FFN of layer 0 and the shared experts. gate_proj and
    up_proj run as one GEMM (`FusedRows`) whose [T, 2 I] output the activation reads as is."""

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
        self.gate_up = FusedRows(self, ("gate_proj", "up_proj"))

    def forward(self, x_TD):
        h = self.gate_up.linear(x_TD)  # [T, 2 I]: gate | up
        return self.down_proj(gated_act(h, self.act, self.beta, self.linear_beta))
