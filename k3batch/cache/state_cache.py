"""StateCache: slot-indexed per-request caches for the layers that one model (or stage) holds.

Per KDA layer: the fp32 recurrent state [S, H, K, V] (K-first, as fla's default layout) and the
three conv states [S, 3, C, W-1] (q, k, v; the previous W-1 inputs, oldest first). Per MLA
layer: the latent of every cached token [S, max_seq_len, kv_lora + rope] (the normalized c_kv,
then the un-normalized shared k^R). S slots, handed out by the engine (a request owns one from admission to finish).
Contract: layers read slot state only for sequences with cached_len > 0 and write it back after
every forward, so a freed slot needs no clearing.
"""

import torch


class StateCache:
    def __init__(self, config, layer_ids, *, num_slots: int, max_seq_len: int, device, dtype):
        self.num_slots, self.max_seq_len = num_slots, max_seq_len
        types = config.layer_types
        H, K, W = config.kda_num_heads, config.kda_head_dim, config.short_conv_kernel_size
        self.kda_state, self.kda_conv, self.mla_latent = {}, {}, {}
        for i in layer_ids:
            if types[i] == "kda":
                self.kda_state[i] = torch.zeros(
                    num_slots, H, K, K, dtype=torch.float32, device=device
                )
                self.kda_conv[i] = torch.zeros(
                    num_slots, 3, H * K, W - 1, dtype=dtype, device=device
                )
            else:
                width = config.mla_latent_size
                self.mla_latent[i] = torch.zeros(
                    num_slots, max_seq_len, width, dtype=dtype, device=device
                )

    def bytes_per_slot(self) -> int:
        tensors = [*self.kda_state.values(), *self.kda_conv.values(), *self.mla_latent.values()]
        return sum(t[0].numel() * t.element_size() for t in tensors)


def kda_state_bytes(config, tp_size: int = 1) -> int:
    """fp32 recurrent KDA state of one request on one rank, all KDA layers (heads split tp ways)."""
    heads = config.kda_num_heads // tp_size
    return len(config.kda_layer_ids) * heads * config.kda_head_dim**2 * 4


def mla_bytes_per_token(config, dtype_bytes: int = 2) -> int:
    """Cached MLA latent of one token, all MLA layers (replicated under TP)."""
    return len(config.mla_layer_ids) * config.mla_latent_size * dtype_bytes
