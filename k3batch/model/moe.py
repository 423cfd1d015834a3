"""MoE router and LatentMoE (spec section 6).

Router: sigmoid scores in fp32, top-k selection on score + correction bias, weights from the
unbiased scores (renormalized, times routed_scaling_factor). K3 routes in a latent width:
down-project, experts in the latent, fp32 weighted combine, latent RMSNorm, up-project; the
shared experts run on the full-width input. Kimi Linear's experts run at full width.
Expert ids can be pinned per layer through `ForwardBatch.pinned_routes` (tests of sharded
paths), and are reported through `ForwardBatch.routes_out`.
Shape legend: T tokens, D hidden, Lt latent width, I expert width, E experts, k top-k.
"""

import torch
from torch import nn

from k3batch.model.layers import GatedMLP, RMSNorm, linear
from k3kernels.moe.experts import fused_experts
from k3kernels.moe.mxfp4 import GROUP_SIZE, MXFP4Weight, has_small_scales
from k3kernels.moe.reference import route_reference

EXPERT_DTYPES = ("bf16", "mxfp4")


class Router(nn.Module):
    def __init__(self, config, dtype=None, device=None):
        super().__init__()
        self.top_k, self.renormalize = config.num_experts_per_token, config.moe_renormalize
        self.scaling = config.routed_scaling_factor
        self.weight = nn.Parameter(
            torch.empty(config.num_experts, config.hidden_size, dtype=dtype, device=device)
        )
        self.e_score_correction_bias = nn.Parameter(
            torch.zeros(config.num_experts, dtype=torch.float32, device=device)
        )

    def forward(self, x_TD, pinned_ids=None):
        """Returns (expert ids [T, k] int64, weights [T, k] fp32)."""
        if x_TD.is_cuda and x_TD.dtype == self.weight.dtype == torch.bfloat16:
            # bf16 products are exact in fp32 and summed in fp32: the fp32 GEMM's math with no
            # fp32 copy of the weight per call (CUDA only).
            logits = torch.mm(x_TD, self.weight.t(), out_dtype=torch.float32)
        else:
            logits = x_TD.float() @ self.weight.float().t()
        args = (self.e_score_correction_bias, self.top_k, self.renormalize, self.scaling)
        if pinned_ids is None and logits.is_cuda:
            from k3kernels.moe.route import route  # one kernel for the dozen torch ops

            return route(logits, *args)
        ids = None if pinned_ids is None else pinned_ids.to(logits.device)
        return route_reference(logits, *args, ids_Tk=ids)


class Experts(nn.Module):
    """E gated experts stacked as w13 [E, 2 I, Din] (gate rows w1 then up rows w3, fused so one
    GEMM computes both) and w2 [E, Din, I]. The checkpoint's experts.{e}.w1 / w3 / w2 map onto
    slices of these (`w1` and `w3` are views). Holds experts [first_expert, first_expert + E):
    0 for the whole model, an expert-parallel rank's range otherwise.

    expert_dtype "mxfp4" keeps them packed (uint8, no gradient; the packed bytes in the W4A16
    kernel's word layout, `mxfp4.to_word_layout`, the scales as the checkpoint stores them):
    w13_packed [E, 2 I, Din/2] with w13_scale [E, 2 I, ceil(Din/32)], and w2_packed / w2_scale;
    the forward multiplies them through the W4A16 kernel (`k3kernels.moe.w4a16`), ~0.27x the
    bytes of bf16 experts. "bf16" holds them in the model dtype."""

    def __init__(self, config, in_size: int, dtype=None, device=None, expert_dtype: str = "bf16"):
        super().__init__()
        if expert_dtype not in EXPERT_DTYPES:
            raise ValueError(f"expert_dtype = {expert_dtype!r}; expected one of {EXPERT_DTYPES}")
        E, I = config.num_experts, config.moe_intermediate_size
        self.act, self.beta, self.linear_beta = (
            config.hidden_act,
            config.situ_beta,
            config.situ_linear_beta,
        )
        self.first_expert = 0
        self.gemm_impl = "auto"  # grouped GEMMs: "auto", "torch" or "triton" (`fused_experts`)
        self.packed = expert_dtype == "mxfp4"
        self.small_scales = False  # `note_packed_scales_` sets it once the weights are in
        if not self.packed:
            self.w13 = nn.Parameter(torch.empty(E, 2 * I, in_size, dtype=dtype, device=device))
            self.w2 = nn.Parameter(torch.empty(E, in_size, I, dtype=dtype, device=device))
            return
        for name, rows, cols in (("w13", 2 * I, in_size), ("w2", in_size, I)):
            if cols % 2:
                raise ValueError(f"MXFP4 experts need an even input width, {name} has {cols}")
            for part, width in (("packed", cols // 2), ("scale", -(-cols // GROUP_SIZE))):
                t = torch.empty(E, rows, width, dtype=torch.uint8, device=device)
                self.register_parameter(f"{name}_{part}", nn.Parameter(t, requires_grad=False))

    @property
    def w1(self):
        """Gate weights [E, I, Din] (a view of w13)."""
        return self.w13[:, : self.w2.shape[2]]

    @property
    def w3(self):
        """Up weights [E, I, Din] (a view of w13)."""
        return self.w13[:, self.w2.shape[2] :]

    def weights(self):
        """(w13, w2) as the kernels take them: tensors, or `MXFP4Weight`s when packed."""
        if self.packed:
            return (MXFP4Weight(self.w13_packed, self.w13_scale, self.small_scales),
                    MXFP4Weight(self.w2_packed, self.w2_scale, self.small_scales))  # fmt: skip
        return self.w13, self.w2

    def forward(self, x_TD, ids_Tk, weights_Tk, *, out_dtype=torch.float32, adds=()):
        """sum_i w_i E_i(x) per token over the experts held here, accumulated in fp32;
        returns [T, Din] in out_dtype (default fp32), plus adds (up to two of out_dtype) in
        order, rounded as `(sum.to(out_dtype) + a0) + a1`. Grouped GEMMs, no host sync
        (`k3kernels.moe.experts`)."""
        w13, w2 = self.weights()
        return fused_experts(
            x_TD, w13, w2, ids_Tk, weights_Tk, act=self.act, beta=self.beta,
            linear_beta=self.linear_beta, first_expert=self.first_expert, gemm_impl=self.gemm_impl,
            out_dtype=out_dtype, adds=adds,
        )  # fmt: skip


def note_packed_scales_(model: nn.Module) -> nn.Module:
    """Record on each packed `Experts` of `model` whether all its scales are small
    (`MXFP4Weight.small_scales`: the W4A16 kernel's fast path). Reads the scales once (a host
    sync per layer): every path that writes expert weights calls it when done."""
    for m in model.modules():
        if isinstance(m, Experts) and m.packed:
            m.small_scales = has_small_scales(m.w13_scale, m.w2_scale)
    return model


class SparseMoE(nn.Module):
    """HF `block_sparse_moe`: gate (router), experts, shared_experts, and for K3 the latent
    projections routed_expert_down_proj / routed_expert_up_proj / routed_expert_norm."""

    def __init__(self, config, layer_idx: int, dtype=None, device=None, expert_dtype="bf16"):
        super().__init__()
        self.layer_idx = layer_idx
        D, latent = config.hidden_size, config.routed_expert_hidden_size
        self.gate = Router(config, dtype, device)
        self.experts = Experts(config, latent or D, dtype, device, expert_dtype)
        if config.num_shared_experts:
            inter = config.moe_intermediate_size * config.num_shared_experts
            self.shared_experts = GatedMLP(config, D, inter, dtype, device)
        if latent is not None:
            self.routed_expert_down_proj = linear(D, latent, dtype, device)
            self.routed_expert_up_proj = linear(latent, D, dtype, device)
            if config.latent_moe_use_norm:
                self.routed_expert_norm = RMSNorm(latent, config.rms_norm_eps, dtype, device)

    def forward(self, x_TD, batch, residual=None):
        """The block's output [T, D], plus residual ([T, D], x's dtype) when given."""
        pinned = (batch.pinned_routes or {}).get(self.layer_idx)
        ids, w = self.gate(x_TD, pinned)
        if batch.routes_out is not None:
            batch.routes_out[self.layer_idx] = ids
        shared = self.shared_experts(x_TD) if hasattr(self, "shared_experts") else None
        if not hasattr(self, "routed_expert_down_proj"):
            # Kimi Linear: the cast, the shared expert and the residual added in the combine
            adds = tuple(a for a in (shared, residual) if a is not None)
            return self.experts(x_TD, ids, w, out_dtype=x_TD.dtype, adds=adds)
        y = self.experts(self.routed_expert_down_proj(x_TD), ids, w).to(x_TD.dtype)
        if hasattr(self, "routed_expert_norm"):
            y = self.routed_expert_norm(y)
        y = self.routed_expert_up_proj(y)
        y = y if shared is None else y + shared
        return y if residual is None else y + residual
