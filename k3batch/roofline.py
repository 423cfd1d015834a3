"""Decode roofline: the fewest bytes one decode step must move through device memory, and the
time that takes at a measured copy bandwidth.

A step of B sequences must read every weight outside the routed experts once (attention,
dense FFN, shared experts, routers, norms, AttnRes, the LM head; of the embedding only B rows),
each routed expert that some token of the step selected once (however many tokens chose it),
each sequence's KDA recurrent state (fp32) and conv states twice (read, then written back), and
each sequence's MLA latents (every cached token, plus the new one written). Everything else (the
activations, the logits) is small beside these and left out: the floor is a lower bound.
"""

from dataclasses import dataclass

import torch

COPY_TBPS_H200 = 4.26  # device-to-device copy measured on the H200 (bytes read + written)


@dataclass(frozen=True, kw_only=True, slots=True)
class DecodeBytes:
    dense: int  # weights outside the routed experts (embedding: B rows)
    experts: int  # the routed experts selected in the step
    kda: int  # KDA states and conv states, read and written
    mla: int  # MLA latents read, plus the new tokens written

    @property
    def total(self) -> int:
        return self.dense + self.experts + self.kda + self.mla

    def floor_ms(self, tbps: float = COPY_TBPS_H200) -> float:
        return self.total / (tbps * 1e12) * 1e3


def _is_routed(name: str) -> bool:
    return ".block_sparse_moe.experts." in name


def decode_bytes(model, *, context_lens: list[int], experts_selected: dict[int, int]) -> DecodeBytes:
    """Bytes of one decode step of `model` (a K3Model, any device, meta included) over
    sequences with `context_lens` tokens already cached; experts_selected: MoE layer index ->
    number of distinct routed experts the step's tokens chose there."""
    cfg = model.config
    B = len(context_lens)
    dense = experts_per_layer = 0
    routed: dict[int, int] = {}
    for name, p in model.named_parameters():
        nbytes = p.numel() * p.element_size()
        if _is_routed(name):
            layer = int(name.split(".")[2])
            routed[layer] = routed.get(layer, 0) + nbytes
        elif name == "model.embed_tokens.weight":
            dense += B * p.shape[1] * p.element_size()
        else:
            dense += nbytes
    for layer, nbytes in routed.items():
        experts_per_layer += experts_selected.get(layer, 0) * nbytes // cfg.num_experts
    act_bytes = next(model.parameters()).element_size()
    C, W = cfg.kda_proj_size, cfg.short_conv_kernel_size
    per_kda = cfg.kda_num_heads * cfg.kda_head_dim**2 * 4 + 3 * C * (W - 1) * act_bytes
    kda = 2 * B * per_kda * len(cfg.kda_layer_ids)
    token = cfg.mla_latent_size * act_bytes
    mla = sum(n + 1 for n in context_lens) * token * len(cfg.mla_layer_ids)
    return DecodeBytes(dense=dense, experts=experts_per_layer, kda=kda, mla=mla)


class RouteCounter:
    """Counts the distinct routed experts each MoE layer selects during the forwards run while
    it is installed (forward hooks on the routers): `with RouteCounter(model) as rc: ...`,
    then `rc.selected` (layer index -> distinct experts in the last forward)."""

    def __init__(self, model):
        self.model, self.selected, self._handles = model, {}, []

    def __enter__(self):
        for idx, layer in self.model.model.layers.items():
            moe = getattr(layer, "block_sparse_moe", None)
            if moe is not None:
                hook = self._hook(int(idx))
                self._handles.append(moe.gate.register_forward_hook(hook))
        return self

    def _hook(self, layer: int):
        def record(module, args, out):
            ids = out[0]
            self.selected[layer] = int(torch.unique(ids).numel())

        return record

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles.clear()
