"""ForwardBatch: the metadata of one forward call, passed explicitly to every layer.

Tokens of several sequences are packed along one axis in the order of `seq_lens`. A sequence
with `cached_len == 0` starts from an empty state whatever its KDA block holds. Cache
addresses are indices in the device's arena (`cache/arena.py`): a KDA block per sequence and a
table of MLA page numbers per sequence (page i holds tokens i*page_size .. of the sequence;
under DCP, of the rank's stripe). The cache binds its views to the batch before the forward
(`PagedCache.bind`): `page_rows` turns page numbers into rows of the page views and `mla_pages`
holds those views, so the model reads and writes pages without importing the cache. Binding also
puts the per-sequence indices the kernels read on the device (`slots`, `positions`) with a host
bound on the attended lengths (`max_len`), so that a decode step reads no Python list on the
device side: the CUDA-graph runner (`engine/graphs.py`) binds its static buffers instead.
"""

from dataclasses import dataclass

import torch


def to_device(values: list[int], device) -> torch.Tensor:
    """A host list of indices as a device int64 tensor, copied without waiting for the device
    (`torch.tensor(values, device=...)` is a blocking copy: it drains the stream)."""
    return torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)


@dataclass
class ForwardBatch:
    seq_lens: list[int]  # new tokens of each sequence in this call
    cached_lens: list[int]  # tokens of each sequence already in the cache
    slot_ids: list[int] | None = None  # KDA block per sequence; None: no cache (one-shot forward)
    page_tables: list[list[int]] | None = None  # MLA page numbers per sequence
    pinned_routes: dict[int, torch.Tensor] | None = None  # layer_idx -> [T, top_k] expert ids
    routes_out: dict[int, torch.Tensor] | None = None  # filled: layer_idx -> [T, top_k] ids
    page_rows: torch.Tensor | None = None  # set by PagedCache.bind: [B, max pages] view rows
    # set by PagedCache.bind: MLA layer_idx -> its page view [pages, page_size, kv_lora + rope]
    mla_pages: dict[int, torch.Tensor] | None = None
    slots: torch.Tensor | None = None  # set by bind: slot_ids on the device [B] int64
    positions: torch.Tensor | None = None  # set by bind: cached_lens on the device
    max_len: int = 0  # set by bind for decode: a host bound on cached_lens + 1 (split sizing)

    def __post_init__(self):
        if len(self.seq_lens) != len(self.cached_lens):
            raise ValueError("seq_lens and cached_lens differ in length")
        if self.slot_ids is not None and len(self.slot_ids) != len(self.seq_lens):
            raise ValueError("slot_ids and seq_lens differ in length")
        if self.page_tables is not None and len(self.page_tables) != len(self.seq_lens):
            raise ValueError("page_tables and seq_lens differ in length")

    @classmethod
    def fresh(cls, seq_lens: list[int]) -> "ForwardBatch":
        """A cache-free forward over whole sequences."""
        return cls(seq_lens=list(seq_lens), cached_lens=[0] * len(seq_lens))

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return sum(self.seq_lens)

    @property
    def cu_seqlens(self) -> list[int]:
        out = [0]
        for n in self.seq_lens:
            out.append(out[-1] + n)
        return out

    @property
    def is_decode(self) -> bool:
        return all(n == 1 for n in self.seq_lens) and all(c > 0 for c in self.cached_lens)

    @property
    def last_token_idx(self) -> list[int]:
        """Index in the packed axis of each sequence's last new token."""
        return [c - 1 for c in self.cu_seqlens[1:]]
