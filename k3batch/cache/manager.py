"""CacheManager: the engine's bookkeeping of one account's memory (pure Python, no torch).

An account is a set of byte arenas that hold the same requests (a model on one device, every
stage of a pipeline, every rank of a decode group): one `Arena` places their blocks and pages
and every allocation must fit in all of them. The manager gives each running request one KDA
block and the MLA pages of its tokens, shares prefix pages and KDA checkpoints through a
`RadixCache` (prefill side), and queues the byte moves the arenas must apply (`drain`) before
their next call.

Contract: `admit`, `grow` and `save_checkpoint` never overcommit: they evict unlocked prefix
entries (least recently used first) and, when that is not enough, return False / None having
changed nothing else, so that the scheduler can wait or retract. Pages are reference-counted
(owners: requests and tree nodes); a page or block is freed, and the last one of its kind moved
into its place, when its last owner lets go. Indices given out (`block_of`, `pages_of`) are
valid until the next call that frees something.
"""

import itertools
from dataclasses import dataclass, field

from k3batch.cache.arena import Arena, ArenaSpec, Move
from k3batch.cache.prefix import Node, RadixCache


@dataclass
class _Owned:
    block: int
    pages: list[int]
    node: Node | None = None  # the prefix node this request keeps locked
    rows: list[int] | None = None  # the pages' arena indices (`pages_of`); None: to recompute


@dataclass
class PoolStats:
    admitted: int = 0
    admission_waits: int = 0  # admissions deferred for lack of room
    retracted: int = 0
    prefix_hits: int = 0
    prefix_hit_tokens: int = 0  # prompt tokens not recomputed
    prompt_tokens: int = 0  # prompt tokens of admitted requests
    checkpoints_saved: int = 0
    evicted_nodes: int = 0
    peak_used_bytes: list[int] = field(default_factory=list)


class CacheManager:
    def __init__(
        self,
        specs: list[ArenaSpec],
        *,
        page_size: int,
        static_blocks: int | None = None,
        prefix_cache: bool = False,
        dcp_size: int = 1,
    ):
        """page_size: tokens per page in each arena (local tokens under DCP). static_blocks:
        None for the unified pool, else the KDA blocks of a static split."""
        if prefix_cache and dcp_size > 1:
            raise ValueError("a prefix cache needs whole-sequence pages (dcp_size = 1)")
        self.arena = Arena(specs, static_blocks=static_blocks)
        self.page_size, self.dcp_size = page_size, dcp_size
        self.tree = RadixCache(page_size) if prefix_cache else None
        self.stats = PoolStats(peak_used_bytes=[0] * len(specs))
        self._moves: list[Move] = []
        self._handles = itertools.count()
        self._page_refs: dict[int, int] = {}
        self._owned: dict[str, _Owned] = {}
        self._holders: dict[int, set[str]] = {}  # page handle -> requests holding it

    # ---- what the arenas and forwards need ---------------------------------------------------
    def drain(self) -> list[Move]:
        """The moves queued since the last drain, in order."""
        out, self._moves = self._moves, []
        return out

    def block_of(self, rid: str) -> int:
        return self.arena.block_idx[self._owned[rid].block]

    def pages_of(self, rid: str) -> list[int]:
        """`rid`'s page indices, in token order (the caller must not change the list). Kept
        between calls: a decode step asks for every running request's, and recomputing them
        cost O(pages) each; a request's list is extended when it grows and recomputed only
        after the arena moved one of its pages (a free elsewhere packing the arena)."""
        own = self._owned[rid]
        if own.rows is None:
            own.rows = [self.arena.page_idx[h] for h in own.pages]
        return own.rows

    def pages_for(self, num_tokens: int) -> int:
        """Pages that hold num_tokens tokens of a sequence (its stripe, under DCP)."""
        local = -(-num_tokens // self.dcp_size)
        return -(-local // self.page_size)

    def holds(self, rid: str) -> bool:
        return rid in self._owned

    @property
    def num_requests(self) -> int:
        return len(self._owned)

    # ---- requests -----------------------------------------------------------------------------
    def admit(self, rid: str, tokens: list[int], num_tokens: int, points=()) -> int | None:
        """Give request `rid` a block and the pages of its first num_tokens tokens. With a
        prefix cache, reuse the deepest checkpoint on `tokens`' path at one of `points`
        (cut positions of the request's own chunk plan, so that a hit computes exactly what
        a miss would). Returns the number of tokens already cached (0 on a miss), or None
        when it does not fit even after eviction."""
        assert rid not in self._owned, f"request {rid} already holds memory"
        hit, shared, node = 0, [], None
        if self.tree is not None:
            hit, shared, node = self.tree.match(tokens, set(points))
            self.tree.lock(node)
        need = self.pages_for(num_tokens) - len(shared)
        fits = self._make_room(1, need)
        if hit and (not fits or node.checkpoint is None):
            # The locked hit itself may be in the way, or making room evicted its checkpoint
            # (checkpoints are evictable even on locked paths): admit it as a miss.
            self.tree.unlock(node)
            hit, shared, node = 0, [], self.tree.root
            self.tree.lock(node)
            need = self.pages_for(num_tokens)
            fits = self._make_room(1, need)
        if not fits:
            if node is not None:
                self.tree.unlock(node)
            self.stats.admission_waits += 1
            return None
        block = self._alloc_block()
        if hit:
            src, dst = self.arena.block_idx[node.checkpoint], self.arena.block_idx[block]
            self._moves.append(Move("block", src, dst))
        for h in shared:
            self._page_refs[h] += 1
        own = self._owned[rid] = _Owned(block, list(shared) + self._alloc_pages(need), node)
        for h in own.pages:
            self._holders.setdefault(h, set()).add(rid)
        self.stats.admitted += 1
        self.stats.prompt_tokens += len(tokens)
        if hit:
            self.stats.prefix_hits += 1
            self.stats.prefix_hit_tokens += hit
        return hit

    def grow(self, rid: str, num_tokens: int) -> bool:
        """Make sure `rid` has pages for num_tokens tokens; False if they do not fit."""
        own = self._owned[rid]
        need = self.pages_for(num_tokens) - len(own.pages)
        if need <= 0:
            return True
        if not self._make_room(0, need):
            return False
        new = self._alloc_pages(need)
        own.pages += new
        for h in new:
            self._holders.setdefault(h, set()).add(rid)
        if own.rows is not None:  # a new list: a batch built before may still hold the old one
            own.rows = own.rows + [self.arena.page_idx[h] for h in new]
        return True

    def release(self, rid: str) -> None:
        """Free everything `rid` holds (finished, aborted, retracted or handed off)."""
        own = self._owned.pop(rid)
        self._free_block(own.block)
        for h in own.pages:  # first, so that no move below reaches the released request
            holders = self._holders[h]
            holders.discard(rid)
            if not holders:
                del self._holders[h]
        self._unref_pages(own.pages)
        if own.node is not None:
            self.tree.unlock(own.node)

    def save_checkpoint(self, rid: str, tokens: list[int]) -> bool:
        """After `rid`'s forward over `tokens` (a whole number of pages) is queued: share its
        pages of them through the tree and keep a copy of its KDA block as the checkpoint at
        their end (queued after that forward). False if there was no room for the copy."""
        if self.tree is None or not tokens:
            return False
        own = self._owned[rid]
        node, taken = self.tree.insert(tokens, own.pages[: len(tokens) // self.page_size])
        for h in taken:
            self._page_refs[h] += 1
        self.tree.lock(node)  # the request now keeps the deeper node
        if own.node is not None:
            self.tree.unlock(own.node)
        own.node = node
        if node.checkpoint is not None:
            return True
        if not self._make_room(1, 0):
            return False
        self.tree.set_checkpoint(node, self._alloc_block())
        src, dst = self.arena.block_idx[own.block], self.arena.block_idx[node.checkpoint]
        self._moves.append(Move("block", src, dst))
        self.stats.checkpoints_saved += 1
        return True

    # ---- internals --------------------------------------------------------------------------
    def _make_room(self, num_blocks: int, num_pages: int) -> bool:
        while not self.arena.can_fit(num_blocks, num_pages):
            victim = self.tree.evict_lru() if self.tree is not None else None
            if victim is None:
                return False
            pages, checkpoint = victim
            self._unref_pages(pages)
            if checkpoint is not None:
                self._free_block(checkpoint)
            self.stats.evicted_nodes += 1
        return True

    def _alloc_block(self) -> int:
        h = next(self._handles)
        self.arena.alloc_block(h)
        self._note_peak()
        return h

    def _alloc_pages(self, n: int) -> list[int]:
        out = [next(self._handles) for _ in range(n)]
        self.arena.alloc_pages(out)
        for h in out:
            self._page_refs[h] = 1
        self._note_peak()
        return out

    def _free_block(self, h: int) -> None:
        self._moves += self.arena.free_block(h)

    def _unref_pages(self, handles) -> None:
        """Drop a reference to each page; those left unreferenced leave the arena together
        (`Arena.free_pages`: each page that stays is copied at most once)."""
        freed = []
        for h in handles:
            self._page_refs[h] -= 1
            if self._page_refs[h] == 0:
                del self._page_refs[h]
                freed.append(h)
        moves = self.arena.free_pages(freed)
        for m in moves:  # pages moved into the holes: their holders' rows
            for rid in self._holders.get(self.arena.pages[m.dst], ()):
                self._owned[rid].rows = None
        self._moves += moves

    def _note_peak(self) -> None:
        used = self.arena.used_bytes()
        self.stats.peak_used_bytes = [max(a, b) for a, b in zip(self.stats.peak_used_bytes, used)]

    def check_integrity(self) -> None:
        """Arena packed; every page's count equals its owners (requests and tree nodes);
        every live block is a request's or a checkpoint; the tree is consistent."""
        self.arena.check_integrity()
        refs: dict[int, int] = {}
        blocks = [o.block for o in self._owned.values()]
        for o in self._owned.values():
            for h in o.pages:
                refs[h] = refs.get(h, 0) + 1
        if self.tree is not None:
            self.tree.check_integrity()
            for n in self.tree.nodes():
                for h in n.pages:
                    refs[h] = refs.get(h, 0) + 1
                if n.checkpoint is not None:
                    blocks.append(n.checkpoint)
        assert refs == self._page_refs, "page reference counts differ from their owners"
        for rid, o in self._owned.items():
            fresh = [self.arena.page_idx[h] for h in o.pages]
            assert o.rows is None or o.rows == fresh, f"{rid}: stale page rows"
            assert all(rid in self._holders[h] for h in o.pages), f"{rid}: holders"
        held = sum(len(o.pages) for o in self._owned.values())
        assert sum(map(len, self._holders.values())) == held, "holders differ from the requests"
        assert sorted(blocks) == sorted(self.arena.blocks), "live blocks differ from owners"
        assert set(refs) == set(self.arena.pages), "live pages differ from owners"
