"""Arena: where fixed-size KDA blocks and MLA pages live in one byte range (pure Python).

Blocks are packed from the left (block i at byte i * block_bytes), pages from the right (page
j at byte total - (j + 1) * page_bytes); the free space between them is shared. Freeing a
block or a page moves the last one of its kind into the hole, so both ends stay packed and the
free middle stays contiguous: there is no fragmentation, and capacity is a byte count. Blocks
and pages have their own sizes (no common page size is forced on them).

One Arena places the blocks and pages of an *account*: every byte arena that holds the same
requests (every stage of a pipeline, every rank of a decode group). They all receive the same
operations in the same order, so their indices agree; only their byte sizes differ, and an
allocation must fit in each (`ArenaSpec`). The caller names blocks and pages by handles
(ints) that never change; `block_idx` / `page_idx` give their current index. Every free
returns the moves (kind, src, dst) the byte arenas must apply, in order, before the next
forward (`cache.paged.PagedCache.apply`).

The static mode reserves a fixed number of block indices on the left and gives pages the rest:
the two-region split that the unified mode replaces, kept for comparison.
"""

from dataclasses import dataclass
from typing import NamedTuple


@dataclass(frozen=True, kw_only=True, slots=True)
class ArenaSpec:
    """One byte arena: its size and the sizes of one block and one page in it."""

    total_bytes: int
    block_bytes: int
    page_bytes: int

    def max_blocks(self) -> int:
        return self.total_bytes // self.block_bytes if self.block_bytes else 1 << 62

    def max_pages(self, reserved_blocks: int = 0) -> int:
        free = self.total_bytes - reserved_blocks * self.block_bytes
        return free // self.page_bytes if self.page_bytes else 1 << 62


class Move(NamedTuple):
    kind: str  # "block" | "page"
    src: int  # index before the move
    dst: int  # index after


class Arena:
    def __init__(self, specs: list[ArenaSpec], *, static_blocks: int | None = None):
        """static_blocks: None for the unified pool; else the blocks reserved on the left."""
        if not specs:
            raise ValueError("an arena account needs at least one ArenaSpec")
        self.specs, self.static_blocks = list(specs), static_blocks
        if static_blocks is not None:
            fits = [s.max_blocks() for s in specs]
            if min(fits) < static_blocks:
                raise ValueError(
                    f"static split of {static_blocks} KDA blocks does not fit: arenas hold "
                    f"{fits} blocks"
                )
        self.blocks: list[int] = []  # handle at each index
        self.pages: list[int] = []
        self.block_idx: dict[int, int] = {}
        self.page_idx: dict[int, int] = {}

    # ---- capacity --------------------------------------------------------------------------
    def can_fit(self, num_blocks: int = 0, num_pages: int = 0) -> bool:
        """Whether num_blocks more blocks and num_pages more pages fit in every arena."""
        b, p = len(self.blocks) + num_blocks, len(self.pages) + num_pages
        if self.static_blocks is not None:
            return b <= self.static_blocks and all(
                p <= s.max_pages(self.static_blocks) for s in self.specs
            )
        return all(b * s.block_bytes + p * s.page_bytes <= s.total_bytes for s in self.specs)

    def used_bytes(self) -> list[int]:
        """Bytes in use in each arena."""
        b, p = len(self.blocks), len(self.pages)
        return [b * s.block_bytes + p * s.page_bytes for s in self.specs]

    # ---- allocation ------------------------------------------------------------------------
    def alloc_block(self, handle: int) -> int:
        if not self.can_fit(num_blocks=1):
            raise MemoryError("no room for a KDA block")
        return _place(handle, self.blocks, self.block_idx)

    def alloc_pages(self, handles) -> list[int]:
        """Place pages at the packed end, with one room check for all (none placed, and a
        MemoryError, unless all fit); returns their indices."""
        if not self.can_fit(num_pages=len(handles)):
            raise MemoryError(f"no room for {len(handles)} MLA page(s)")
        return [_place(h, self.pages, self.page_idx) for h in handles]

    def free_block(self, handle: int) -> list[Move]:
        return _free(handle, self.blocks, self.block_idx, "block")

    def free_pages(self, handles) -> list[Move]:
        """Free several pages at once: the live pages above the new end fill the holes below
        it, each copied once (freed one by one, the last page filled each hole in turn and a
        page could move again and again)."""
        holes = sorted(self.page_idx.pop(h) for h in handles)
        end = len(self.pages) - len(holes)
        freed = set(holes)
        movers = [i for i in range(end, len(self.pages)) if i not in freed]
        moves = []
        for src, dst in zip(movers, holes):  # the holes below end, as many as the movers
            h = self.pages[dst] = self.pages[src]
            self.page_idx[h] = dst
            moves.append(Move("page", src, dst))
        del self.pages[end:]
        return moves

    def check_integrity(self) -> None:
        """Both ends packed (indices 0..n-1), maps consistent, every arena within its bytes."""
        for order, index in ((self.blocks, self.block_idx), (self.pages, self.page_idx)):
            assert len(order) == len(index) == len(set(order))
            assert all(index[h] == i for i, h in enumerate(order))
        assert self.can_fit(0, 0), "arena over capacity"


def _place(handle: int, order: list[int], index: dict[int, int]) -> int:
    """Put `handle` at the end of its packed side; returns its index."""
    assert handle not in index, f"handle {handle} already placed"
    index[handle] = len(order)
    order.append(handle)
    return index[handle]


def _free(handle: int, order: list[int], index: dict[int, int], kind: str) -> list[Move]:
    hole = index.pop(handle)
    last = order.pop()
    if last == handle:
        return []
    order[hole] = last
    index[last] = hole
    return [Move(kind, len(order), hole)]
