"""Random weights for test checkpoints, scaled so that activations stay O(1) through all
layers and logits are neither flat nor one-hot. Deterministic for a given seed and device.

Rules: projections N(0, 1/fan_in); projections that write into the stream are scaled down by
0.5; norms 1 + N(0, 0.1) (so a swapped norm is visible); AttnRes pseudo-queries N(0, 1/D)
(softmax scores O(1)); KDA A_log = log U(1, 16) and dt_bias around -1 (decays per step in
roughly [0.4, 1) with the -5 lower bound); router correction bias N(0, 0.1) so that selection
visibly differs from the unbiased scores.
"""

import math

import torch
from torch import nn

from k3batch.model.moe import note_packed_scales_
from k3kernels.moe.mxfp4 import quantize_mxfp4, to_word_layout

_OUT_PROJ = ("o_proj", "down_proj", "w2", "routed_expert_up_proj")


@torch.no_grad()
def init_random_(model: nn.Module, seed: int = 0) -> nn.Module:
    device = next(model.parameters()).device  # draw where the weights live (GPU: seconds)
    gen = torch.Generator(device=device).manual_seed(seed)

    def normal(shape, std, mean=0.0):
        return torch.randn(shape, generator=gen, dtype=torch.float32, device=device) * std + mean

    params = dict(model.named_parameters())
    for name, p in params.items():
        leaf = name.split(".")[-2] if name.endswith(".weight") else name.split(".")[-1]
        shape = p.shape
        if leaf.endswith("_scale"):
            continue  # filled with its packed values below
        if leaf.endswith("_packed"):  # packed experts: drawn as the bf16 ones, then quantized
            _init_packed_(p, params[name.removesuffix("_packed") + "_scale"], leaf, normal)
            continue
        if "norm" in leaf:
            val = normal(shape, 0.1, 1.0)
        elif leaf.endswith("res_proj"):
            val = normal(shape, 1 / math.sqrt(shape[-1]))
        elif leaf == "embed_tokens":
            val = normal(shape, 1.0)
        elif leaf == "A_log":
            val = torch.rand(shape, generator=gen, device=device).mul(15).add(1).log()
        elif leaf == "dt_bias":
            val = normal(shape, 0.5, -1.0)
        elif leaf == "e_score_correction_bias":
            val = normal(shape, 0.1)
        elif leaf.endswith("conv1d"):
            val = normal(shape, 0.5)
        elif leaf == "w13":  # fused experts: drawn as w1 then w3, as when they were two params
            for rows in p.chunk(2, dim=1):
                rows.copy_(normal(rows.shape, 1 / math.sqrt(shape[-1])).to(p.dtype))
            continue
        else:  # projections and stacked experts: fan_in is the last dim
            std = 1 / math.sqrt(shape[-1]) * (0.5 if leaf in _OUT_PROJ else 1.0)
            val = normal(shape, std)
        p.copy_(val.to(p.dtype))
    return note_packed_scales_(model)


def _init_packed_(packed, scale, leaf: str, normal) -> None:
    """MXFP4 experts [E, out, in/2] with their scales: each expert drawn like a bf16 one (w13 as
    its w1 then w3 rows, w2 scaled as an output projection), then quantized, one at a time."""
    fan_in = 2 * packed.shape[-1]
    std = 1 / math.sqrt(fan_in) * (0.5 if leaf == "w2_packed" else 1.0)
    for e in range(packed.shape[0]):
        w = normal((packed.shape[1], fan_in), std)
        p, s = quantize_mxfp4(w)
        packed[e].copy_(to_word_layout(p))
        scale[e].copy_(s)
