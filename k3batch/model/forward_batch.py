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
A prefill's index tensors (`varlen`: the offsets and fla's chunk table for KDA;
`token_addresses`: the MLA page rows of every token; a decode step's `decode_addresses`) are
built by the first layer that asks,
in one non-blocking copy each, and shared by the other layers: none waits for the device.
"""

from dataclasses import dataclass, field

import torch
from k3kernels.kda.varlen import Varlen, make_varlen


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
    # Per-forward index tensors, built by the first layer that asks and shared by the others:
    # device -> Varlen; (device, page_size) -> MLA token addresses, ("decode", page_size) -> a
    # decode step's. Not copied by replace().
    _varlen: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _addresses: dict = field(default_factory=dict, init=False, repr=False, compare=False)

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

    def varlen(self, device) -> Varlen:
        """cu_seqlens with its device tensors (offsets, fla's chunk table), made by one
        non-blocking copy the first time and reused by every KDA layer of the forward."""
        key = str(device)
        if key not in self._varlen:
            self._varlen[key] = make_varlen(self.cu_seqlens, device)
        return self._varlen[key]

    def token_addresses(self, device, page_size: int) -> "TokenAddresses":
        """Where the MLA layers write the new tokens' latents and read every sequence's whole
        latent (prefix + new) in their pages, as rows of the page views and slots within a
        page: computed once for the forward (every MLA layer of a cache has the same pages).
        Needs `page_rows` (bound by the cache)."""
        key = (str(device), page_size)
        if key not in self._addresses:
            self._addresses[key] = _token_addresses(self, device, page_size)
        return self._addresses[key]

    def decode_addresses(self, page_size: int) -> "DecodeAddresses":
        """Where a decode step's MLA layers write each sequence's new latent, and the attended
        lengths: from the bound device tensors (`positions`, `page_rows`), four small kernels
        once a step instead of in each of the MLA layers (graph-capturable: no host read)."""
        key = ("decode", page_size)
        if key not in self._addresses:
            pos = self.positions  # bound by the cache: pages checked there
            rows = self.page_rows.gather(1, (pos // page_size)[:, None])[:, 0]
            lens = (pos + 1).to(torch.int32)
            self._addresses[key] = DecodeAddresses(rows, pos % page_size, lens)
        return self._addresses[key]

    @property
    def is_decode(self) -> bool:
        return all(n == 1 for n in self.seq_lens) and all(c > 0 for c in self.cached_lens)

    @property
    def last_token_idx(self) -> list[int]:
        """Index in the packed axis of each sequence's last new token."""
        return [c - 1 for c in self.cu_seqlens[1:]]


@dataclass(frozen=True)
class TokenAddresses:
    """Page rows and in-page slots of the new tokens ([T]) and, where any sequence has a
    cached prefix, of every sequence's whole latent ([S], S = sum of cached + new), with the
    key offsets cu_k [B+1] int64 for the attention kernel (None: no prefix, the query
    offsets serve)."""

    rows_T: torch.Tensor
    slots_T: torch.Tensor
    rows_S: torch.Tensor | None
    slots_S: torch.Tensor | None
    cu_k: torch.Tensor | None


@dataclass(frozen=True)
class DecodeAddresses:
    """One new token per sequence ([B]): its page row and in-page slot, and the sequence's
    length with it (int32, as the attention kernel reads it)."""

    rows_B: torch.Tensor
    slots_B: torch.Tensor
    seq_lens_B: torch.Tensor


def _positions(counts: list[int], starts: list[int]) -> tuple[list[int], list[int]]:
    """(sequence, position) of each of sum(counts) packed tokens: token j of sequence b sits
    at position starts[b] + j."""
    seq, pos = [], []
    for b, (n, s) in enumerate(zip(counts, starts)):
        seq += [b] * n
        pos += range(s, s + n)
    return seq, pos


def _token_addresses(batch: ForwardBatch, device, page_size: int) -> TokenAddresses:
    """Built on the host from the batch's lists, copied in one non-blocking transfer, turned
    into page rows by one gather on the device."""
    lens, cached = batch.seq_lens, batch.cached_lens
    seq, pos = _positions(lens, cached)
    T, prefix = len(seq), any(cached)
    if prefix:
        k_lens = [c + n for c, n in zip(cached, lens)]
        seq_S, pos_S = _positions(k_lens, [0] * len(k_lens))
        cu_k = [0]
        for n in k_lens:
            cu_k.append(cu_k[-1] + n)
        seq, pos = seq + seq_S, pos + pos_S
    host = torch.tensor(seq + pos + (cu_k if prefix else []), dtype=torch.long)
    packed = host.to(device, non_blocking=True)
    n = len(seq)
    seq_t, pos_t = packed[:n], packed[n : 2 * n]
    rows, slots = batch.page_rows[seq_t, pos_t // page_size], pos_t % page_size
    if not prefix:
        return TokenAddresses(rows, slots, None, None, None)
    return TokenAddresses(rows[:T], slots[:T], rows[T:], slots[T:], packed[2 * n :])
