"""The radix tree's eviction order against a brute-force oracle: under random inserts,
matches, locks, unlocks, checkpoints and evictions, `evict_lru` takes the candidate (an
unlocked leaf, or any node with a checkpoint) of least (last use, deepest first), the one a
walk over the whole tree finds, and its heap stays within a bound of the tree's size."""

import random

from k3batch.cache.prefix import RadixCache


def _oracle(tree: RadixCache):
    nodes = [n for n in tree.nodes() if n is not tree.root and n.candidate]
    return min(nodes, key=lambda n: (n.last_use, -n.end), default=None)


def test_evict_lru_matches_a_walk_of_the_tree():
    ps, handles = 2, iter(range(10**9))
    for seed in range(20):
        rng = random.Random(seed)
        tree, locked = RadixCache(ps), []
        bases = [[rng.randint(1, 3) for _ in range(2 * rng.randint(2, 8))] for _ in range(3)]
        evictions = 0
        for _ in range(400):
            ops = ["insert", "match", "unlock", "checkpoint", "evict"]
            op = rng.choices(ops, [4, 3, 2, 2, 3])[0]
            tokens = rng.choice(bases) + [rng.randint(1, 3) for _ in range(2 * rng.randint(0, 4))]
            if op == "insert":
                pages = [next(handles) for _ in range(len(tokens) // ps)]
                node, _ = tree.insert(tokens, pages)
                if rng.random() < 0.5:
                    tree.lock(node)
                    locked.append(node)
            elif op == "match":
                tree.match(tokens, set(range(0, len(tokens) + 1, ps)))
            elif op == "unlock" and locked:
                tree.unlock(locked.pop(rng.randrange(len(locked))))
            elif op == "checkpoint":
                node, _ = tree.insert(tokens, [next(handles) for _ in range(len(tokens) // ps)])
                if node.checkpoint is None:
                    tree.set_checkpoint(node, next(handles))
            elif op == "evict":
                want = _oracle(tree)
                whole = want is not None and not want.children and want.lock_ref == 0
                got = tree.evict_lru()
                if want is None:
                    assert got is None
                    continue
                evictions += 1
                assert got is not None
                pages, checkpoint = got
                assert (pages == want.pages if whole else pages == []), "a different victim"
                assert want.alive is not whole and want.checkpoint is None
            tree.check_integrity()
            assert len(tree._heap) <= 4 * len(tree.nodes()) + 65
        assert evictions > 20
