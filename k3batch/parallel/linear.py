"""Parallel leaf layers of a decode rank; each takes its communicator (`ParallelGroup`) as an
argument and keeps `nn.Linear`-like `weight` parameters, so state-dict names stay the official
ones and only the shapes are local.

- `RowParallelLinear`: the input columns of this rank; the partial outputs are summed
  (all-reduce). Column-parallel layers need no class: a plain Linear with the local rows.
- `VocabParallelLMHead`: the vocabulary rows of this rank; logits are all-gathered to the full
  vocabulary on every rank (so every rank can sample the same token).
- `ExpertParallelExperts`: the experts [first, first + E/N) of this rank; each rank sums the
  weighted outputs of its experts per token in fp32, and the partial sums are all-reduced in
  fp32 before the caller casts and normalizes (sum(norm(x_i)) != norm(sum(x_i))).
- `ParallelSparseMoE`: the MoE block of a rank; routed and shared partials share one
  all-reduce (one collective per MoE layer instead of two).
Shape legend: T tokens, D hidden, V vocabulary, E experts, I expert width, k top-k.
"""

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from k3batch.model.layers import GatedMLP
from k3batch.model.moe import Experts, SparseMoE
from k3batch.parallel.group import ParallelGroup


class RowParallelLinear(nn.Linear):
    """y = all_reduce(x_local W_local^T): weight [out, in / group.size], no bias."""

    def __init__(self, local_in_size: int, out_size: int, group: ParallelGroup, dtype=None,
                 device=None):  # fmt: skip
        super().__init__(local_in_size, out_size, bias=False, dtype=dtype, device=device)
        self.group = group

    def forward(self, x):
        return self.group.all_reduce(F.linear(x, self.weight))


class VocabParallelLMHead(nn.Linear):
    """logits [T, V] = all_gather over ranks of x W_local^T; weight [V / group.size, D]."""

    def __init__(self, hidden_size: int, local_vocab_size: int, group: ParallelGroup,
                 dtype=None, device=None):  # fmt: skip
        super().__init__(hidden_size, local_vocab_size, bias=False, dtype=dtype, device=device)
        self.group = group

    def forward(self, x_TD):
        return self.group.all_gather(F.linear(x_TD, self.weight), dim=-1)


class ExpertParallelExperts(Experts):
    """This rank's slice of the stacked experts: w13 [E/N, 2 I, Din], w2 [E/N, Din, I], holding
    global experts [first_expert, first_expert + E/N). Takes global expert ids."""

    def __init__(self, config, in_size: int, group: ParallelGroup, dtype=None, device=None,
                 expert_dtype: str = "bf16"):  # fmt: skip
        E, N = config.num_experts, group.size
        if E % N:
            raise ValueError(f"tp_size = {N} does not divide num_experts = {E}")
        local = dataclasses.replace(config, num_experts=E // N)
        super().__init__(local, in_size, dtype=dtype, device=device, expert_dtype=expert_dtype)
        self.num_local_experts, self.first_expert = E // N, group.rank * (E // N)
        self.group = group

    def forward(self, x_TD, ids_Tk, weights_Tk):
        """sum over the token's experts of w_i E_i(x), fp32 [T, Din], summed over all ranks."""
        return self.group.all_reduce(self.partial(x_TD, ids_Tk, weights_Tk))

    def partial(self, x_TD, ids_Tk, weights_Tk):
        """The same sum restricted to this rank's experts (not reduced), fp32 [T, Din]."""
        return super().forward(x_TD, ids_Tk, weights_Tk)


class ParallelSparseMoE(SparseMoE):
    """SparseMoE of one rank with ONE all-reduce: the experts' fp32 partial sum and the shared
    experts' partial output (down_proj over this rank's columns) travel packed in one fp32
    buffer [T, Din + D]. The router is full-size and replicated; the latent projections and
    norm are replicated and run after the reduction. Built on the meta device by tp.py (the
    parent constructor allocates full-size experts, replaced here)."""

    def __init__(self, config, layer_idx: int, group: ParallelGroup, dtype=None, device=None,
                 expert_dtype: str = "bf16"):  # fmt: skip
        super().__init__(config, layer_idx, dtype, device)
        self.group = group
        D = config.hidden_size
        self.experts = ExpertParallelExperts(
            config, config.routed_expert_hidden_size or D, group, dtype, device, expert_dtype
        )
        if config.num_shared_experts:
            inter = config.moe_intermediate_size * config.num_shared_experts
            if inter % group.size:
                raise ValueError(f"tp_size = {group.size} does not divide shared width {inter}")
            self.shared_experts = GatedMLP(config, D, inter // group.size, dtype, device)

    def forward(self, x_TD, batch, residual=None):
        ids, w = self.gate(x_TD, (batch.pinned_routes or {}).get(self.layer_idx))
        if batch.routes_out is not None:
            batch.routes_out[self.layer_idx] = ids
        latent = hasattr(self, "routed_expert_down_proj")
        x_in = self.routed_expert_down_proj(x_TD) if latent else x_TD
        parts = [self.experts.partial(x_in, ids, w)]
        if hasattr(self, "shared_experts"):
            parts.append(self.shared_experts(x_TD).float())  # partial: local down_proj columns
        summed = self.group.all_reduce(torch.cat(parts, dim=-1))
        y = summed[:, : x_in.shape[1]].to(x_TD.dtype)
        if hasattr(self, "routed_expert_norm"):
            y = self.routed_expert_norm(y)  # after the sum: norm(sum x_i), not sum norm(x_i)
        if latent:
            y = self.routed_expert_up_proj(y)
        if hasattr(self, "shared_experts"):
            y = y + summed[:, x_in.shape[1] :].to(x_TD.dtype)
        return y if residual is None else y + residual
