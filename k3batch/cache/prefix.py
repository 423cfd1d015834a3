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
before saving a checkpoint at the returned node. The pages of locked nodes and their ancestors
are never evicted. `evict_lru` removes the least recently used entry and returns its page and
block handles for the caller to release; the caller holds the reference counts.
"""

import itertools


class Node:
    __slots__ = ("checkpoint", "children", "key", "last_use", "lock_ref", "pages", "parent")

    def __init__(self, parent, key: tuple, pages: list[int]):
        self.parent, self.key, self.pages = parent, key, pages
        self.children: dict[tuple, Node] = {}
        self.checkpoint: int | None = None  # KDA block handle at the end of this node
        self.lock_ref = 0
        self.last_use = 0

    @property
    def end(self) -> int:
        """Tokens from the root to the end of this node."""
        n, node = 0, self
        while node is not None:
            n, node = n + len(node.key), node.parent
        return n


class RadixCache:
    def __init__(self, page_size: int):
        self.page_size = page_size
        self.root = Node(None, (), [])
        self.root.lock_ref = 1  # never evicted
        self._clock = itertools.count(1)

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
            node.last_use = now
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
                taken += new.pages
                node, at = new, len(tokens)
                node.last_use = now
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
            node.last_use = now
        return node, taken

    def _split(self, node: Node, num_tokens: int) -> Node:
        """Cut `node` after num_tokens (page-aligned); returns the new upper part."""
        ps, parent = self.page_size, node.parent
        upper = Node(parent, node.key[:num_tokens], node.pages[: num_tokens // ps])
        upper.lock_ref, upper.last_use = node.lock_ref, node.last_use
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
        while node is not None:
            node.lock_ref -= 1
            assert node.lock_ref >= 0, "unlock without lock"
            node = node.parent

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
        nodes = self.nodes()
        leaves = [n for n in nodes if not n.children and n.lock_ref == 0]
        saved = [n for n in nodes if n.checkpoint is not None]
        if not leaves and not saved:
            return None
        victim = min(leaves + saved, key=lambda n: n.last_use)
        checkpoint, victim.checkpoint = victim.checkpoint, None
        if victim.children or victim.lock_ref:
            return [], checkpoint
        del victim.parent.children[victim.key[: self.page_size]]
        return victim.pages, checkpoint

    def check_integrity(self) -> None:
        """Keys page-aligned, child keys consistent, lock counts no smaller than children's."""
        for n in self.nodes():
            if n is not self.root:
                assert len(n.key) % self.page_size == 0 and len(n.key) > 0
                assert len(n.pages) == len(n.key) // self.page_size
                assert n.parent.children[n.key[: self.page_size]] is n
            assert n.lock_ref >= sum(c.lock_ref for c in n.children.values())
