"""Bytes of one request's fixed KDA block and of one MLA page, for the layers one arena holds.

A KDA block holds, per KDA layer, the fp32 recurrent state [H, K, V] and the three conv states
[3, C, W-1] (model dtype). An MLA page holds `page_size` tokens' latents [page_size, kv_lora +
rope] per MLA layer (under DCP: `page_size` tokens of the rank's stripe). Every segment starts
on an ALIGN-byte boundary. The planner (`k3batch.parallel.plan`) and every runner size their
pools with these numbers, so the plan and the pools cannot disagree.
"""

from dataclasses import dataclass

ALIGN = 256  # bytes; segment and arena boundaries


def align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True, kw_only=True, slots=True)
class CacheLayout:
    kda_layers: tuple[int, ...]
    mla_layers: tuple[int, ...]
    num_heads: int  # KDA heads on this rank
    head_dim: int  # K = V
    conv_len: int  # W - 1 previous inputs kept per conv
    latent_size: int  # kv_lora + rope
    page_size: int  # tokens per MLA page
    dtype_bytes: int  # conv states and latents; recurrent states are fp32

    @classmethod
    def build(cls, config, layer_ids, *, page_size: int, dtype_bytes: int, tp_size: int = 1):
        """The layout of the layers `layer_ids` on one rank of a TP group (KDA heads split)."""
        if page_size < 1:
            raise ValueError(f"page_size = {page_size} must be >= 1")
        types = config.layer_types
        ids = tuple(layer_ids)
        return cls(
            kda_layers=tuple(i for i in ids if types[i] == "kda"),
            mla_layers=tuple(i for i in ids if types[i] != "kda"),
            num_heads=config.kda_num_heads // tp_size,
            head_dim=config.kda_head_dim,
            conv_len=config.short_conv_kernel_size - 1,
            latent_size=config.mla_latent_size,
            page_size=page_size,
            dtype_bytes=dtype_bytes,
        )

    # ---- one KDA block: per layer [state | conv] -------------------------------------------
    @property
    def state_bytes(self) -> int:
        return self.num_heads * self.head_dim**2 * 4

    @property
    def conv_bytes(self) -> int:
        return 3 * self.num_heads * self.head_dim * self.conv_len * self.dtype_bytes

    @property
    def layer_block_bytes(self) -> int:
        return align(self.state_bytes) + align(self.conv_bytes)

    @property
    def block_bytes(self) -> int:
        return len(self.kda_layers) * self.layer_block_bytes

    def state_offset(self, layer_idx: int) -> int:
        return self.kda_layers.index(layer_idx) * self.layer_block_bytes

    def conv_offset(self, layer_idx: int) -> int:
        return self.state_offset(layer_idx) + align(self.state_bytes)

    # ---- one MLA page: per layer [page_size, latent] ----------------------------------------
    @property
    def layer_page_bytes(self) -> int:
        return align(self.page_size * self.latent_size * self.dtype_bytes)

    @property
    def page_bytes(self) -> int:
        return len(self.mla_layers) * self.layer_page_bytes

    def latent_offset(self, layer_idx: int) -> int:
        return self.mla_layers.index(layer_idx) * self.layer_page_bytes

    @property
    def token_bytes(self) -> int:
        """MLA bytes per cached token, without page rounding."""
        return len(self.mla_layers) * self.latent_size * self.dtype_bytes

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def request_pages(self, num_tokens: int, dcp_size: int = 1) -> int:
        """Pages of one rank for a sequence of num_tokens tokens (its stripe under DCP)."""
        return self.pages_for(-(-num_tokens // dcp_size))

    def request_bytes(self, num_tokens: int, dcp_size: int = 1) -> int:
        """One request of num_tokens tokens on one rank: its KDA block and its pages."""
        return self.block_bytes + self.request_pages(num_tokens, dcp_size) * self.page_bytes


def kda_state_bytes(config, tp_size: int = 1) -> int:
    """fp32 recurrent KDA state of one request on one rank, all KDA layers (heads split tp ways)."""
    heads = config.kda_num_heads // tp_size
    return len(config.kda_layer_ids) * heads * config.kda_head_dim**2 * 4


def mla_bytes_per_token(config, dtype_bytes: int = 2) -> int:
    """Cached MLA latent of one token, all MLA layers (replicated under TP)."""
    return len(config.mla_layer_ids) * config.mla_latent_size * dtype_bytes
