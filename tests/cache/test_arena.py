"""Property tests of cache placement: Arena, PagedCache moves and CacheManager bookkeeping.

Random alloc/free sequences on `Arena` (unified and static, one or several byte arenas) check
the geometry after every operation: live byte ranges never overlap, both ends stay packed, the
free middle is one run, `can_fit` agrees with a direct byte count, and every free reports
exactly the index changes it made. On real `PagedCache`s, applying those moves keeps the bytes
of every live block and page (through the typed views too) while unused bytes keep a 0xFF
poison (NaN in every float view). Random `CacheManager` traffic, with and without a prefix
cache, runs `check_integrity()` after every operation, checks the eviction contract and
follows every block and page (checkpoint copies included) byte for byte.
"""

import itertools
import random

import pytest
import torch

from k3batch.cache.arena import Arena, ArenaSpec, Move
from k3batch.cache.layout import CacheLayout
from k3batch.cache.manager import CacheManager
from k3batch.cache.paged import PagedCache
from k3batch.model.config import get_flavor

POISON = 0xFF  # bf16 0xFFFF and fp32 0xFFFFFFFF are NaN
KINDS = ("block", "page")

SPECS = {
    "1arena": [ArenaSpec(total_bytes=24_000, block_bytes=1_700, page_bytes=230)],
    "3arenas": [
        ArenaSpec(total_bytes=24_000, block_bytes=1_700, page_bytes=230),
        ArenaSpec(total_bytes=9_000, block_bytes=300, page_bytes=170),  # pages run out first
        ArenaSpec(total_bytes=30_000, block_bytes=3_100, page_bytes=40),  # blocks run out first
    ],
}
MODES = {"unified": None, "static6": 6}


# ---- geometry -----------------------------------------------------------------------------
def _fits(specs, static_blocks, nb: int, np_: int, db: int, dp: int) -> bool:
    """Direct byte count: nb + db blocks end before np_ + dp pages begin, in every arena (and
    in static mode, blocks stay left of the split and pages right of it)."""
    for s in specs:
        block_end = (nb + db) * s.block_bytes
        page_start = s.total_bytes - (np_ + dp) * s.page_bytes
        if static_blocks is None:
            if block_end > page_start:
                return False
        elif nb + db > static_blocks or page_start < static_blocks * s.block_bytes:
            return False
    return True


def _check_geometry(arena: Arena, mirror: dict, static_blocks) -> None:
    """mirror: {"block": {handle: index}, "page": {...}} as the test predicts it."""
    arena.check_integrity()
    assert arena.block_idx == mirror["block"] and arena.page_idx == mirror["page"]
    nb, np_ = len(mirror["block"]), len(mirror["page"])
    assert sorted(mirror["block"].values()) == list(range(nb)), "blocks not packed"
    assert sorted(mirror["page"].values()) == list(range(np_)), "pages not packed"
    for s in arena.specs:
        ranges = [(i * s.block_bytes, (i + 1) * s.block_bytes) for i in mirror["block"].values()]
        ranges += [
            (s.total_bytes - (j + 1) * s.page_bytes, s.total_bytes - j * s.page_bytes)
            for j in mirror["page"].values()
        ]
        ranges.sort()
        for (_, end), (start, _) in itertools.pairwise(ranges):
            assert end <= start, f"live ranges overlap in {s}"
        assert not ranges or (ranges[0][0] >= 0 and ranges[-1][1] <= s.total_bytes)
        block_end, page_start = nb * s.block_bytes, s.total_bytes - np_ * s.page_bytes
        free = s.total_bytes - nb * s.block_bytes - np_ * s.page_bytes
        assert page_start - block_end == free >= 0, "the free middle is not one run"
        if static_blocks is not None:
            assert block_end <= static_blocks * s.block_bytes <= page_start


def _free_and_follow(arena: Arena, mirror: dict, kind: str, handle: int):
    """Free `handle`, check the reported moves (the last one of its kind into the hole) and
    replay them on the mirror. Returns the moves."""
    index = mirror[kind]
    hole, last = index.pop(handle), len(index)
    moves = arena.free_block(handle) if kind == "block" else arena.free_pages([handle])
    assert moves == ([] if hole == last else [(kind, last, hole)])
    for _, src, dst in moves:
        (moved,) = [h for h, i in index.items() if i == src]
        assert dst not in index.values()
        index[moved] = dst
    return moves


def _random_ops(rng: random.Random, num_ops: int):
    """Yield num_ops op names; the alloc/free mix changes every 40 ops, so that the arena goes
    from empty to full and back."""
    for n in range(num_ops):
        if n % 40 == 0:
            p_alloc = rng.choice((0.25, 0.55, 0.9))
        yield ("alloc_" if rng.random() < p_alloc else "free_") + rng.choice(KINDS)


@pytest.mark.parametrize("static_blocks", MODES.values(), ids=MODES.keys())
@pytest.mark.parametrize("specs", SPECS.values(), ids=SPECS.keys())
def test_arena_random_ops_keep_geometry(specs, static_blocks):
    num_full = 0
    for seed in range(50):  # 50 sequences x 300 ops per case, 4 cases
        rng = random.Random(seed)
        arena = Arena(specs, static_blocks=static_blocks)
        mirror = {"block": {}, "page": {}}
        handles = iter(range(10**9))
        for op in _random_ops(rng, 300):
            nb, np_ = len(mirror["block"]), len(mirror["page"])
            db, dp = rng.randint(0, 3), rng.randint(0, 20)
            assert arena.can_fit(db, dp) == _fits(specs, static_blocks, nb, np_, db, dp)
            kind = op.split("_")[1]
            if op.startswith("alloc"):
                h = next(handles)
                one = (1, 0) if kind == "block" else (0, 1)
                alloc = arena.alloc_block if kind == "block" else _alloc_page(arena)
                if _fits(specs, static_blocks, nb, np_, *one):
                    mirror[kind][h] = alloc(h)
                    assert mirror[kind][h] == len(mirror[kind]) - 1  # at the packed end
                else:
                    num_full += 1
                    with pytest.raises(MemoryError):
                        alloc(h)
            elif mirror[kind]:
                _free_and_follow(arena, mirror, kind, rng.choice(list(mirror[kind])))
            _check_geometry(arena, mirror, static_blocks)
    assert num_full > 100, "the sequences should often fill the arena"


def test_arena_static_split_must_fit():
    with pytest.raises(ValueError, match="static split"):
        Arena(SPECS["3arenas"], static_blocks=10)  # the third arena holds 9 blocks


# ---- bytes: PagedCache ----------------------------------------------------------------------
def _layout(layers) -> CacheLayout:
    return CacheLayout.build(get_flavor("k3-debug"), layers, page_size=4, dtype_bytes=2)


class _Bytes:
    """One PagedCache whose unused bytes hold POISON and whose live blocks and pages hold
    patterns known by key (handle, request id, ...)."""

    def __init__(self, layout: CacheLayout, total_bytes: int, gen: torch.Generator):
        self.cache = PagedCache(layout, total_bytes, device="cpu", dtype=torch.bfloat16)
        self.cache.arena.fill_(POISON)
        self.gen, self.expected = gen, {}
        self.sizes = {"block": layout.block_bytes, "page": layout.page_bytes}

    def span(self, kind: str, idx: int) -> slice:
        n = self.sizes[kind]
        start = idx * n if kind == "block" else self.cache.total_bytes - (idx + 1) * n
        return slice(start, start + n)

    def write(self, kind: str, idx: int, key) -> None:
        """A fresh pattern at block/page idx, remembered as `key`'s bytes."""
        pattern = torch.randint(0, 256, (self.sizes[kind],), generator=self.gen).to(torch.uint8)
        self.cache.arena[self.span(kind, idx)] = pattern
        self.expected[key] = pattern

    def holds(self, kind: str, idx: int, key) -> bool:
        return torch.equal(self.cache.arena[self.span(kind, idx)], self.expected[key])

    def poison_middle(self, nb: int, np_: int) -> None:
        self.cache.arena[self.middle(nb, np_)] = POISON

    def middle(self, nb: int, np_: int) -> slice:
        return slice(nb * self.sizes["block"], self.cache.total_bytes - np_ * self.sizes["page"])

    def middle_is_poison(self, nb: int, np_: int) -> bool:
        return bool((self.cache.arena[self.middle(nb, np_)] == POISON).all())

    def views_hold(self, kind: str, idx: int, key) -> bool:
        """The typed views of block/page idx show `key`'s pattern, segment by segment."""
        lay, c, pattern = self.cache.layout, self.cache, self.expected[key]
        if kind == "block":
            segments = [(c.kda_state[i][idx], lay.state_offset(i)) for i in lay.kda_layers]
            segments += [(c.kda_conv[i][idx], lay.conv_offset(i)) for i in lay.kda_layers]
        else:
            row = int(c.rows([idx])[0])
            segments = [(c.mla_latent[i][row], lay.latent_offset(i)) for i in lay.mla_layers]
        for view, offset in segments:
            got = _as_bytes(view)
            if not torch.equal(got, pattern[offset : offset + got.numel()]):
                return False
        return True


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).reshape(-1)


STAGES = {  # one PagedCache per stage of an account; total bytes per stage
    "1stage": [(range(8), 110_000)],
    "2stages": [(range(8), 110_000), (range(8, 20), 100_000)],
}


@pytest.mark.parametrize("static_blocks", [None, 3], ids=["unified", "static3"])
@pytest.mark.parametrize("stages", STAGES.values(), ids=STAGES.keys())
def test_paged_moves_keep_bytes(stages, static_blocks):
    for seed in range(12):  # 12 sequences x 200 ops per case
        rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
        pools = [_Bytes(_layout(layers), total, gen) for layers, total in stages]
        arena = Arena([p.cache.spec for p in pools], static_blocks=static_blocks)
        mirror = {"block": {}, "page": {}}
        handles = iter(range(10**9))
        for op in _random_ops(rng, 200):
            kind = op.split("_")[1]
            moved = []
            if op.startswith("alloc"):
                if not arena.can_fit(*((1, 0) if kind == "block" else (0, 1))):
                    continue
                h = next(handles)
                alloc = arena.alloc_block if kind == "block" else _alloc_page(arena)
                mirror[kind][h] = alloc(h)
                for p in pools:
                    p.write(kind, mirror[kind][h], (kind, h))
            elif mirror[kind]:
                moves = _free_and_follow(arena, mirror, kind, rng.choice(list(mirror[kind])))
                for p in pools:
                    p.cache.apply(moves)
                    # The vacated slot still holds the moved copy (or the freed bytes): unused.
                    vacated = len(mirror[kind])
                    p.cache.arena[p.span(kind, vacated)] = POISON
                moved = [(kind, h) for h, i in mirror[kind].items() if moves and i == moves[0].dst]
            nb, np_ = len(mirror["block"]), len(mirror["page"])
            for p in pools:
                assert p.middle_is_poison(nb, np_), "a move wrote into the free middle"
                for k in KINDS:
                    for h, i in mirror[k].items():
                        assert p.holds(k, i, (k, h)), f"{k} {h} at {i} lost its bytes"
                for k, h in moved:
                    assert p.views_hold(k, mirror[k][h], (k, h))
        for p in pools:  # the end state through every typed view; a free slot reads NaN
            for k in KINDS:
                for h, i in mirror[k].items():
                    assert p.views_hold(k, i, (k, h))
            nb, np_ = len(mirror["block"]), len(mirror["page"])
            lay = p.cache.layout
            if (nb + 1) * lay.block_bytes <= p.cache.total_bytes - np_ * lay.page_bytes:
                assert torch.isnan(p.cache.kda_state[lay.kda_layers[0]][nb]).all()


def _alloc_page(arena):
    return lambda h: arena.alloc_pages([h])[0]


def test_paged_apply_in_a_stage_without_mla_layers():
    kda_only = PagedCache(_layout(range(3)), 60_000, device="cpu", dtype=torch.bfloat16)
    mixed = PagedCache(_layout(range(3, 8)), 60_000, device="cpu", dtype=torch.bfloat16)
    arena = Arena([kda_only.spec, mixed.spec])
    arena.alloc_pages(range(3))
    moves = arena.free_pages([0])  # [Move("page", 2, 0)]
    mixed.apply(moves)
    kda_only.apply(moves)  # page_bytes == 0: nothing to copy


def _one_by_one(cache: PagedCache, moves) -> None:
    """Each move a copy of its own, in order: what `PagedCache.apply` must equal."""
    for kind, src, dst in moves:
        n = cache.layout.block_bytes if kind == "block" else cache.layout.page_bytes
        at = (lambda i: i * n) if kind == "block" else (lambda i: cache.total_bytes - (i + 1) * n)
        cache.arena[at(dst) : at(dst) + n] = cache.arena[at(src) : at(src) + n].clone()


@pytest.mark.parametrize("group_bytes", [None, 3], ids=["default", "tiny-groups"])
def test_paged_apply_of_many_moves_equals_them_one_by_one(monkeypatch, group_bytes):
    """apply runs a run of moves of one kind as one gather and one scatter; where a move reads
    or overwrites what an earlier one wrote (chains, cycles, one slot written twice), or the
    group would exceed MOVE_GROUP_BYTES, it starts a new group, so the bytes end as with one
    copy per move. Moves drawn at random, and those of many frees drained at once."""
    import k3batch.cache.paged as paged

    if group_bytes is not None:  # a group of whole rows never exceeds it: one move each
        monkeypatch.setattr(paged, "MOVE_GROUP_BYTES", group_bytes)
    copy_rows = PagedCache._copy_rows

    def one_gather(self, group):  # on a GPU a slot written twice in one scatter is a race
        assert len({m.dst for m in group}) == len(group), group
        assert group_bytes is None or len(group) == 1
        copy_rows(self, group)

    monkeypatch.setattr(PagedCache, "_copy_rows", one_gather)
    layout = _layout(range(8))
    rng, gen = random.Random(0), torch.Generator().manual_seed(0)
    a = PagedCache(layout, 120_000, device="cpu", dtype=torch.bfloat16)
    b = PagedCache(layout, 120_000, device="cpu", dtype=torch.bfloat16)
    nb, np_ = 6, 10  # slots used: blocks from the left, pages from the right, apart
    assert nb * layout.block_bytes + np_ * layout.page_bytes <= a.total_bytes
    for trial in range(20):
        a.arena.copy_(torch.randint(0, 256, a.arena.shape, generator=gen, dtype=torch.uint8))
        b.arena.copy_(a.arena)
        moves = []
        for _ in range(rng.randint(1, 30)):
            kind = rng.choice(["block", "page"])
            src, dst = rng.sample(range(nb if kind == "block" else np_), 2)
            moves.append(Move(kind, src, dst))
        moves += [Move("page", 1, 2), Move("page", 2, 3), Move("page", 3, 1)]  # a cycle
        a.apply(moves)
        _one_by_one(b, moves)
        assert torch.equal(a.arena, b.arena), f"trial {trial}: {moves}"
    arena = Arena([a.spec])  # a compaction's moves, drained after many frees
    arena.alloc_pages(range(np_))
    moves = arena.free_pages([0, 3, 4]) + arena.free_pages([1]) + arena.free_pages([9, 2])
    a.apply(moves)
    _one_by_one(b, moves)
    assert torch.equal(a.arena, b.arena)


# ---- CacheManager ---------------------------------------------------------------------------
MANAGER_CASES = {
    "unified-noprefix": (None, False),
    "unified-prefix": (None, True),
    "static6-prefix": (6, True),
}


def _fits_after_evicting(mgr: CacheManager, reqs, num_blocks: int, num_pages: int) -> bool:
    """Whether num_blocks blocks and num_pages pages would fit once every unlocked tree entry
    is gone: an unlocked node's subtree is unlocked, so all of them can go, freeing their
    checkpoints and the pages that no request holds."""
    if mgr.tree is None:
        return mgr.arena.can_fit(num_blocks, num_pages)
    held = {mgr.arena.pages[i] for rid in reqs for i in mgr.pages_of(rid)}
    unlocked = [n for n in mgr.tree.nodes() if n.lock_ref == 0]
    blocks = sum(n.checkpoint is not None for n in unlocked)
    pages = len({h for n in unlocked for h in n.pages} - held)
    return mgr.arena.can_fit(num_blocks - blocks, num_pages - pages)


@pytest.mark.parametrize("static_blocks, prefix", MANAGER_CASES.values(), ids=MANAGER_CASES)
def test_manager_random_traffic(static_blocks, prefix):
    ps = 4
    totals = {"admit_fail": 0, "grow_fail": 0, "hits": 0, "evicted": 0}
    for seed in range(25):  # 25 sequences x 300 ops per case
        rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
        pool = _Bytes(_layout(range(8)), 140_000, gen)  # 8 blocks or 136 pages
        mgr = CacheManager(
            [pool.cache.spec], page_size=ps, static_blocks=static_blocks, prefix_cache=prefix
        )
        bases = [[rng.randint(1, 3) for _ in range(rng.randint(8, 24))] for _ in range(3)]
        reqs: dict[str, list] = {}  # rid -> [tokens, tokens covered by its pages]
        rids = (f"r{n}" for n in range(10**9))
        for _ in range(300):
            op = rng.choices(["admit", "grow", "save", "release"], [4, 4, 2, 3])[0]
            if op != "admit" and not reqs:
                continue
            rid = next(rids) if op == "admit" else rng.choice(list(reqs))
            tree_nodes = mgr.tree.nodes() if prefix else []
            locked = [n for n in tree_nodes if n.lock_ref > 0]
            blocks_before = set(mgr.arena.blocks)
            evicted_before = mgr.stats.evicted_nodes
            written = []  # (kind, index, key) the forward of this op writes
            if op == "admit":
                tokens = rng.choice(bases) + [rng.randint(1, 3) for _ in range(rng.randint(0, 16))]
                points = range(ps, len(tokens), ps)
                room = mgr.arena.can_fit(1, mgr.pages_for(len(tokens)))
                hit = mgr.admit(rid, tokens, len(tokens), points)
                if room:
                    assert hit is not None and mgr.stats.evicted_nodes == evicted_before
                if hit is None:
                    totals["admit_fail"] += 1
                    assert not mgr.holds(rid)
                    # Not even as a miss (a hit is never required), after evicting everything.
                    assert not _fits_after_evicting(mgr, reqs, 1, mgr.pages_for(len(tokens)))
                else:
                    assert hit == 0 or hit in points
                    totals["hits"] += hit > 0
                    reqs[rid] = [tokens, len(tokens)]
                    first_own = hit // ps  # pages before it are the tree's, read-only
                    if hit:  # the block must hold the checkpoint's copy before the forward
                        _, _, node = mgr.tree.match(tokens, {hit})
                        written.append(("check", mgr.block_of(rid), ("ckpt", node.checkpoint)))
                    written.append(("block", mgr.block_of(rid), ("req", rid)))
                    written += [("page", i, None) for i in mgr.pages_of(rid)[first_own:]]
            elif op == "grow":
                step = rng.randint(1, 12)
                tokens, covered = reqs[rid]
                tokens += [rng.randint(1, 3) for _ in range(step)]
                num_pages = len(mgr.pages_of(rid))
                need = mgr.pages_for(covered + step) - num_pages
                room = mgr.arena.can_fit(0, max(need, 0))
                if mgr.grow(rid, covered + step):
                    assert not room or mgr.stats.evicted_nodes == evicted_before
                    reqs[rid][1] = covered + step
                    written.append(("block", mgr.block_of(rid), ("req", rid)))
                    written += [("page", i, None) for i in mgr.pages_of(rid)[num_pages:]]
                else:
                    totals["grow_fail"] += 1
                    del tokens[-step:]
                    assert not room and not _fits_after_evicting(mgr, reqs, 0, need)
            elif op == "save":
                tokens, covered = reqs[rid]
                cut = rng.randint(0, covered // ps) * ps
                state = pool.expected[("req", rid)]
                mgr.save_checkpoint(rid, tokens[:cut])
                for h in set(mgr.arena.blocks) - blocks_before:  # the new checkpoint
                    pool.expected[("ckpt", h)] = state  # a copy of the request's block
            else:
                mgr.release(rid)
                del reqs[rid], pool.expected[("req", rid)]
            totals["evicted"] += mgr.stats.evicted_nodes - evicted_before
            mgr.check_integrity()
            if prefix and op != "release":
                alive = {id(n) for n in mgr.tree.nodes()}
                assert all(id(n) in alive for n in locked if n.lock_ref > 0), "evicted a lock"
            # The bytes: apply the queued moves, then the forward of this op.
            pool.cache.apply(mgr.drain())
            for kind, idx, key in written:
                if kind == "check":
                    assert pool.holds("block", idx, key), "hit: checkpoint not copied"
                elif kind == "block":
                    pool.write("block", idx, key)
                else:
                    pool.write("page", idx, ("page", mgr.arena.pages[idx]))
            _check_manager_bytes(pool, mgr, reqs)
    assert totals["admit_fail"] and totals["grow_fail"], totals
    if prefix:
        assert totals["hits"] and totals["evicted"], totals


def _check_manager_bytes(pool: _Bytes, mgr: CacheManager, reqs) -> None:
    """Every request's block, every checkpoint and every live page holds its bytes; the free
    middle is poisoned again for the next op."""
    owner = {mgr.block_of(rid): rid for rid in reqs}
    for idx, h in enumerate(mgr.arena.blocks):
        key = ("req", owner[idx]) if idx in owner else ("ckpt", h)
        assert pool.holds("block", idx, key), f"block {idx} ({key}) lost its bytes"
    for idx, h in enumerate(mgr.arena.pages):
        assert pool.holds("page", idx, ("page", h)), f"page {idx} (handle {h}) lost its bytes"
    pool.poison_middle(len(mgr.arena.blocks), len(mgr.arena.pages))


def test_manager_admit_when_its_own_hit_is_in_the_way():
    """The request's cached prefix (a checkpoint and a page) is what fills the pool and nothing
    runs: kept as it is, the hit does not fit, so admit must make room from the hit itself
    (its checkpoint) and admit the request as a miss, rather than refuse it forever or queue a
    copy of a checkpoint it has just freed."""
    spec = ArenaSpec(total_bytes=2500, block_bytes=1000, page_bytes=100)
    mgr = CacheManager([spec], page_size=4, prefix_cache=True)
    a = [1, 2, 3, 4, 5, 6, 7, 8]
    assert mgr.admit("a", a, len(a)) == 0
    assert mgr.save_checkpoint("a", a[:4])  # a checkpoint block and one shared page
    mgr.release("a")  # nothing runs; the tree holds 1100 of 2500 bytes
    b = a[:4] + list(range(20, 44))  # the hit needs 1000 + 600 more bytes, a miss 1000 + 700
    assert mgr.admit("b", b, len(b), points=[4, 8, 12]) == 0
    mgr.check_integrity()


def test_manager_release_copies_only_pages_that_stay():
    """Releasing a request copies only the live pages above where the packed pages end after
    it: none when its pages are the arena's last, one a live page in the way otherwise (freed
    lowest first, half of a lone request's own pages were copied into its own holes)."""
    spec = ArenaSpec(total_bytes=10**6, block_bytes=1000, page_bytes=100)
    mgr = CacheManager([spec], page_size=4)
    mgr.admit("a", [], 4 * 20)
    mgr.drain()
    mgr.release("a")
    assert mgr.drain() == []
    mgr.admit("a", [], 4 * 10)  # pages 0-9
    mgr.admit("b", [], 4 * 3)  # pages 10-12
    mgr.grow("a", 4 * 12)  # pages 13-14
    mgr.drain()
    mgr.release("a")
    moves = [m for m in mgr.drain() if m.kind == "page"]
    assert [(m.src, m.dst) for m in moves] == [(10, 0), (11, 1), (12, 2)]
    assert mgr.pages_of("b") == [0, 1, 2]
    mgr.check_integrity()
