"""PagedCache: the byte arena of one device for the layers that one model, pipeline stage or
decode rank holds, with typed views for the model's layers.

The arena is one uint8 tensor. KDA blocks (one per request, plus read-only prefix
checkpoints) sit at `block * block_bytes` from the left; MLA pages at `total - (page + 1) *
page_bytes` from the right (`arena.Arena` decides the indices; `layout.CacheLayout` the
bytes). The views the layers use:
  kda_state[layer]  [NB, H, K, V] fp32     (block index)
  kda_conv[layer]   [NB, 3, C, W-1]        (block index)
  mla_latent[layer] [NP, page_size, L + R] (row = NP - 1 - page number; `bind` maps them)
The views overlap in the free middle; the Arena keeps live blocks and pages apart. Contract:
`apply(moves)` runs, in order, every move and copy the engine queued since the last call,
before the forward that depends on them; layers read a block only for sequences with
cached_len > 0 and a page only at positions already written, so nothing is ever cleared.
"""

import torch

from k3batch.cache.arena import ArenaSpec, Move
from k3batch.cache.layout import ALIGN, CacheLayout

# The most bytes one gather of `PagedCache.apply` copies (its temporary): a few of K3's KDA
# blocks, a few thousand of its pages.
MOVE_GROUP_BYTES = 256 * 2**20


class PagedCache:
    def __init__(self, layout: CacheLayout, total_bytes: int, *, device, dtype, dcp_size: int = 1):
        """dcp_size: the DCP group this cache's pages belong to (token i of a sequence is
        local token i // dcp_size of one rank's pages)."""
        if dtype.itemsize != layout.dtype_bytes:
            raise ValueError(f"layout.dtype_bytes = {layout.dtype_bytes} does not match {dtype}")
        self.layout, self.page_size, self.dcp_size = layout, layout.page_size, dcp_size
        self.total_bytes = total_bytes // ALIGN * ALIGN
        self.arena = torch.zeros(self.total_bytes, dtype=torch.uint8, device=device)
        bb, pb, total = layout.block_bytes, layout.page_bytes, self.total_bytes
        self.num_blocks = total // bb if bb else 0
        self.num_pages = total // pb if pb else 0
        H, K, W1 = layout.num_heads, layout.head_dim, layout.conv_len
        C = H * K
        blocks = self.arena[: self.num_blocks * bb].view(self.num_blocks, bb)
        pages = self.arena[total - self.num_pages * pb :].view(self.num_pages, pb)
        # Whole blocks and pages as rows of 8-byte words, for `apply` (both sizes are ALIGN
        # multiples; a kind of zero bytes, in a stage without such layers, has none); page p
        # is row num_pages - 1 - p
        self._rows = {kind: rows.view(torch.int64)
                      for kind, rows, n in (("block", blocks, bb), ("page", pages, pb)) if n}  # fmt: skip
        self.kda_state, self.kda_conv, self.mla_latent = {}, {}, {}
        for i in layout.kda_layers:
            s, c = layout.state_offset(i), layout.conv_offset(i)
            self.kda_state[i] = _typed(blocks, s, layout.state_bytes, torch.float32, (H, K, K))
            self.kda_conv[i] = _typed(blocks, c, layout.conv_bytes, dtype, (3, C, W1))
        token = layout.latent_size * layout.dtype_bytes
        for i in layout.mla_layers:
            o = layout.latent_offset(i)
            shape = (self.page_size, layout.latent_size)
            self.mla_latent[i] = _typed(pages, o, self.page_size * token, dtype, shape)

    @property
    def spec(self) -> ArenaSpec:
        return ArenaSpec(
            total_bytes=self.total_bytes,
            block_bytes=self.layout.block_bytes,
            page_bytes=self.layout.page_bytes,
        )

    # ---- engine operations ---------------------------------------------------------------
    def apply(self, moves: list[Move]) -> None:
        """Copy blocks and pages (compaction moves, checkpoint saves and restores) as if one
        after another, in order. Consecutive moves of one kind run as one gather and one
        scatter (`_copy_rows`) while none of them reads or overwrites a block or page that an
        earlier one of the group wrote (a compaction's never do: its sources lie above the
        new end, its holes below), up to MOVE_GROUP_BYTES: a wave of finished requests frees
        thousands of pages in one step (Kimi Linear, 1,024 prompts of 1K, 256 at a time:
        11,905 page moves when the second wave starts), each a launch of its own before."""
        group, written = [], set()
        for move in moves:
            n = self.layout.block_bytes if move.kind == "block" else self.layout.page_bytes
            if n == 0:  # a stage without layers of this kind
                continue
            if group and (move.kind != group[0].kind or move.src in written
                          or move.dst in written or (len(group) + 1) * n > MOVE_GROUP_BYTES):  # fmt: skip
                self._copy_rows(group)
                group, written = [], set()
            group.append(move)
            written.add(move.dst)
        if group:
            self._copy_rows(group)

    def _copy_rows(self, group: list[Move]) -> None:
        """Rows dst = rows src for moves of one kind, sources all read before any write."""
        kind = group[0].kind
        rows, count = self._rows[kind], (self.num_blocks if kind == "block" else self.num_pages)
        for m in group:
            assert 0 <= m.src < count and 0 <= m.dst < count, f"{m} outside [0, {count})"
        src, dst = ([m.src for m in group], [m.dst for m in group])
        if kind == "page":
            src, dst = ([count - 1 - i for i in idx] for idx in (src, dst))
        if len(group) == 1:
            rows[dst[0]].copy_(rows[src[0]])
            return
        src_t, dst_t = torch.tensor([src, dst]).to(rows.device, non_blocking=True)
        rows.index_copy_(0, dst_t, rows.index_select(0, src_t))

    def rows(self, page_numbers) -> torch.Tensor:
        """Rows of the mla_latent views that hold the given page numbers."""
        t = torch.as_tensor(page_numbers, dtype=torch.long)
        return (self.num_pages - 1 - t).to(self.arena.device, non_blocking=True)

    def bind(self, batch) -> None:
        """Put what the kernels read on the device, unless already bound (the CUDA-graph
        runner binds static buffers): batch.slots from slot_ids; batch.positions (cached_lens;
        KDA prefill reads a nonzero one as "continue from the cached state"); for decode,
        max_len; batch.page_rows [B, max pages] (padded) from page_tables
        and batch.mla_pages, this cache's MLA page views (the model reads pages only there).
        Checks here, on the host, that every decoding sequence has a page for its token."""
        dev = self.arena.device
        if batch.slots is None and batch.slot_ids is not None:
            batch.slots = torch.tensor(batch.slot_ids, dtype=torch.long).to(dev, non_blocking=True)
        if batch.positions is None:
            batch.positions = torch.tensor(batch.cached_lens).to(dev, non_blocking=True)
            if batch.is_decode:
                batch.max_len = max(batch.cached_lens) + 1
        if batch.page_tables is None or not self.mla_latent or batch.page_rows is not None:
            return
        batch.mla_pages = self.mla_latent
        if batch.is_decode:
            self.check_decode_pages(batch)
        width = max(1, max(len(t) for t in batch.page_tables))
        padded = [list(t) + [0] * (width - len(t)) for t in batch.page_tables]
        batch.page_rows = self.rows(padded)

    def check_decode_pages(self, batch) -> None:
        """ValueError unless every sequence of a decode batch has the page of its new token
        (local token position // dcp_size on this cache's pages). Host lists only."""
        ps, dcp = self.page_size, self.dcp_size
        for n, (pos, table) in enumerate(zip(batch.cached_lens, batch.page_tables)):
            if (pos // dcp) // ps >= len(table):
                raise ValueError(
                    f"sequence {n} has no page for its token at position {pos} "
                    f"({len(table)} pages of {ps} tokens, dcp_size {dcp})"
                )

    # ---- one request's tensors (handoff, tests) --------------------------------------------
    def request_tensors(self, block: int, pages: list[int], num_tokens: int) -> dict:
        """{"kda_state": {layer: [H, K, V]}, "kda_conv": {layer: [3, C, W-1]},
        "mla_latent": {layer: [num_tokens, L + R]}} (views of the KDA block, copies of the
        gathered MLA tokens)."""
        rows = self.rows(pages[: -(-num_tokens // self.page_size)])
        return {
            "kda_state": {i: t[block] for i, t in self.kda_state.items()},
            "kda_conv": {i: t[block] for i, t in self.kda_conv.items()},
            "mla_latent": {
                i: load_tokens(t, rows[None], num_tokens)[0] for i, t in self.mla_latent.items()
            },
        }

    def write_request_(self, block: int, pages: list[int], tensors: dict) -> None:
        """Store a request's tensors (any subset of this cache's layers, the format of
        `request_tensors`) into a block and pages."""
        rows = self.rows(pages)
        for kind in ("kda_state", "kda_conv", "mla_latent"):
            pool = getattr(self, kind)
            for i, t in tensors.get(kind, {}).items():
                if i not in pool:
                    raise ValueError(f"{kind}: layer {i} is not in this cache")
                if kind != "mla_latent":
                    if t.shape != pool[i].shape[1:]:
                        raise ValueError(
                            f"{kind}[{i}]: {list(t.shape)} != {list(pool[i].shape[1:])}"
                        )
                    pool[i][block].copy_(t)
                elif t.shape[0] > len(pages) * self.page_size or t.shape[1:] != pool[i].shape[2:]:
                    raise ValueError(
                        f"mla_latent[{i}]: {list(t.shape)} does not fit {len(pages)} pages of "
                        f"{list(pool[i].shape[1:])}"
                    )
                else:
                    store_tokens(pool[i], rows, 0, t)


def store_tokens(pool_PNC: torch.Tensor, rows_P: torch.Tensor, start: int, latent_TC) -> None:
    """Write T tokens at positions start.. of one sequence whose page rows are rows_P."""
    ps = pool_PNC.shape[1]
    pos = torch.arange(start, start + latent_TC.shape[0], device=rows_P.device)
    pool_PNC[rows_P[pos // ps], pos % ps] = latent_TC.to(pool_PNC.dtype)


def load_tokens(pool_PNC: torch.Tensor, rows_BP: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """[B, num_tokens, C]: the first num_tokens tokens of B sequences (page rows rows_BP)."""
    ps = pool_PNC.shape[1]
    n = -(-num_tokens // ps)
    return pool_PNC[rows_BP[:, :n]].flatten(1, 2)[:, :num_tokens]


def _typed(rows_NB: torch.Tensor, offset: int, nbytes: int, dtype, shape) -> torch.Tensor:
    """[N, *shape] view of bytes offset..offset+nbytes of every row, as dtype."""
    return rows_NB[:, offset : offset + nbytes].view(dtype).view(rows_NB.shape[0], *shape)
