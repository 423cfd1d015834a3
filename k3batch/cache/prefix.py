"""RadixCache: a radix tree over token ids whose nodes own shared MLA pages and read-only KDA
checkpoints (pure Python; handles only, bytes live in the arenas).

Keys are whole pages: every node covers a page-aligned run of tokens and owns one page handle
per page of it, so a prefix's pages are shared as they are, read-only (a request writes only
past its cached prefix, into pages of its own). A node may also own a *checkpoint*: a KDA
block holding every KDA layer's state (and conv states) after the node's last token. A hit
copies the checkpoint into the request's own block (copy-on-write); nothing writes a
checkpoint after it is saved.

Protocol: `match` finds the deepest usable checkpoint; the caller `lock`s the node whose pages
a request reads (and `unlock`s it when the request is done), and `insert`s a request's pages
before `set_checkpoint` at the returned node. The pages of locked nodes and their ancestors
are never evicted. `evict_lru` removes the least recently used entry and returns its page and
block handles for the caller to release; the caller holds the reference counts.

Eviction candidates are the unlocked leaves and every node with a checkpoint. They sit in a
heap keyed by (last use, deepest first): a path touched by one call shares its time, and its
leaf goes before the checkpoints above it. An entry is pushed whenever a node becomes a
candidate or is touched as one, and checked when popped (a stale time, a node gone or no
longer a candidate: dropped, since a node pushes again when it turns back into one). So an
eviction costs O(log n) amortized, not a walk of the tree (which a job's full cache did on
every checkpoint it saved); the heap is rebuilt from the tree when stale entries outnumber
the nodes 4 to 1.
"""

import heapq
import itertools


class Node:
    __slots__ = ("alive", "checkpoint", "children", "end", "key", "last_use", "lock_ref", "pages",
                 "parent")  # fmt: skip

    def __init__(self, parent, key: tuple, pages: list[int]):
        self.parent, self.key, self.pages = parent, key, pages
        self.end = len(key) + (parent.end if parent is not None else 0)  # tokens from the root
        self.children: dict[tuple, Node] = {}
        self.checkpoint: int | None = None  # KDA block handle at the end of this node
        self.lock_ref = 0
        self.last_use = 0
        self.alive = True  # False once evicted

    @property
    def candidate(self) -> bool:
        """Evictable now: an unlocked leaf (whole) or a checkpoint (alone)."""
        return self.checkpoint is not None or (not self.children and self.lock_ref == 0)


class RadixCache:
    def __init__(self, page_size: int):
        self.page_size = page_size
        self.root = Node(None, (), [])
        self.root.lock_ref = 1  # never evicted
        self._clock = itertools.count(1)
        self._pushes = itertools.count()  # ties of one node's entries never compare nodes
        self._heap: list[tuple[int, int, int, Node]] = []  # (last_use, -end, push, node)
        self._num_nodes = 1

    def _touch(self, node: Node, now: int) -> None:
        node.last_use = now
        if node.candidate:
            self._push(node)

    def _push(self, node: Node) -> None:
        heapq.heappush(self._heap, (node.last_use, -node.end, next(self._pushes), node))
        if len(self._heap) > 4 * self._num_nodes + 64:
            self._heap = [(n.last_use, -n.end, next(self._pushes), n)
                          for n in self.nodes() if n.candidate]  # fmt: skip
            heapq.heapify(self._heap)

    def _child_key(self, tokens, at: int) -> tuple:
        return tuple(tokens[at : at + self.page_size])

    def match(self, tokens: list[int], points) -> tuple[int, list[int], Node]:
        """The deepest node on `tokens`' path that ends at one of `points` and has a
        checkpoint: (its length in tokens, the pages before it, the node). (0, [], root)
        without one. Touches the path (LRU)."""
        best = (0, [], self.root)
        node, at, pages = self.root, 0, []
        now = next(self._clock)
        while True:
            child = node.children.get(self._child_key(tokens, at))
            if child is None or tuple(tokens[at : at + len(child.key)]) != child.key:
                break
            node, at = child, at + len(child.key)
            pages = pages + node.pages
            self._touch(node, now)
            if node.checkpoint is not None and at in points:
                best = (at, pages, node)
        return best

    def insert(self, tokens: list[int], pages: list[int]) -> tuple[Node, list[int]]:
        """Make the path of `tokens` (a whole number of pages; `pages` their handles) exist.
        Returns (the node ending at len(tokens), the handles the tree took over: the caller
        adds one reference to each)."""
        ps = self.page_size
        assert len(tokens) % ps == 0 and len(pages) == len(tokens) // ps
        node, at, taken = self.root, 0, []
        now = next(self._clock)
        while at < len(tokens):
            child = node.children.get(self._child_key(tokens, at))
            if child is None:
                new = Node(node, tuple(tokens[at:]), list(pages[at // ps :]))
                node.children[self._child_key(tokens, at)] = new
                self._num_nodes += 1
                taken += new.pages
                node, at = new, len(tokens)
                self._touch(node, now)
                break
            same = 0  # whole pages in common with the child's key
            while (
                same < len(child.key)
                and at + same < len(tokens)
                and child.key[same : same + ps] == tuple(tokens[at + same : at + same + ps])
            ):
                same += ps
            if same < len(child.key):
                child = self._split(child, same)
            node, at = child, at + same
            self._touch(node, now)
        return node, taken

    def _split(self, node: Node, num_tokens: int) -> Node:
        """Cut `node` after num_tokens (page-aligned); returns the new upper part."""
        ps, parent = self.page_size, node.parent
        upper = Node(parent, node.key[:num_tokens], node.pages[: num_tokens // ps])
        upper.lock_ref, upper.last_use = node.lock_ref, node.last_use
        self._num_nodes += 1  # an inner node without a checkpoint: not a candidate
        parent.children[node.key[:ps]] = upper
        node.parent, node.key = upper, node.key[num_tokens:]
        node.pages = node.pages[num_tokens // ps :]
        upper.children[node.key[:ps]] = node
        return upper

    def lock(self, node: Node) -> None:
        while node is not None:
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: Node) -> None:
        if node.lock_ref == 1 and not node.children:
            self._push(node)  # an unlocked leaf from now on (its ancestors have children)
        while node is not None:
            node.lock_ref -= 1
            assert node.lock_ref >= 0, "unlock without lock"
            node = node.parent

    def set_checkpoint(self, node: Node, handle: int) -> None:
        """Make `handle` (a KDA block) the checkpoint at the end of `node`."""
        assert node.checkpoint is None and node is not self.root
        node.checkpoint = handle
        self._push(node)

    def nodes(self) -> list[Node]:
        out, stack = [], [self.root]
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out

    def evict_lru(self) -> tuple[list[int], int | None] | None:
        """Drop the least recently used entry: an unlocked leaf (its pages and checkpoint) or,
        anywhere, a checkpoint alone (a hit's copy is queued when it is made, so a checkpoint
        is never in use after that). Returns (page handles, checkpoint handle or None) for the
        caller to release, or None when nothing can be evicted."""
        while self._heap:
            last_use, _, _, victim = heapq.heappop(self._heap)
            if victim.alive and victim.last_use == last_use and victim.candidate:
                break
        else:
            return None
        checkpoint, victim.checkpoint = victim.checkpoint, None
        if victim.children or victim.lock_ref:
            return [], checkpoint
        parent = victim.parent
        del parent.children[victim.key[: self.page_size]]
        victim.alive = False
        self._num_nodes -= 1
        if parent.candidate and parent is not self.root:
            self._push(parent)  # its last child gone: an unlocked leaf now
        return victim.pages, checkpoint

    def check_integrity(self) -> None:
        """Keys page-aligned, child keys consistent, lock counts no smaller than children's."""
        for n in self.nodes():
            if n is not self.root:
                assert len(n.key) % self.page_size == 0 and len(n.key) > 0
                assert len(n.pages) == len(n.key) // self.page_size
                assert n.parent.children[n.key[: self.page_size]] is n
            assert n.lock_ref >= sum(c.lock_ref for c in n.children.values())
