"""The radix tree's leaf set (what `evict` scans) stays exactly the childless nodes."""

from __future__ import annotations

import numpy as np

from radix import RadixTree
from radix.tree import Pin

B = 4


def childless(tree: RadixTree) -> set[bytes]:
    return {n.key for n in tree.nodes() if not n.children}


def test_leaf_set_matches_a_full_scan_under_random_operations() -> None:
    rng = np.random.default_rng(7)
    tree = RadixTree(B)
    root = ("ns", "fp")
    pins: dict[bytes, Pin] = {}
    for step in range(400):
        op = rng.integers(0, 10)
        keys = [n.key for n in tree.nodes()]
        if op < 6:  # insert a prompt of 1-4 blocks over a small alphabet, so prefixes are shared
            tokens = rng.integers(0, 3, int(rng.integers(1, 5)) * B)
            parent = None
            for i in range(len(tokens) // B):
                key = tokens[: (i + 1) * B].tobytes()
                tree.insert(root, parent, tokens[i * B : (i + 1) * B], key, 10)
                parent = key
        elif op < 8:
            freed = sum(n.nbytes for n in tree.evict(int(rng.integers(1, 40))))
            assert freed >= 0
        elif op == 8 and keys:
            tree.remove(keys[int(rng.integers(0, len(keys)))])
        elif keys:
            key = keys[int(rng.integers(0, len(keys)))]
            if key in pins:
                tree.unpin(pins.pop(key))
            else:
                pins[key] = tree.pin([tree.get(key)])  # type: ignore[list-item]
        assert set(tree._leaf_nodes) == childless(tree), f"after step {step}"


def test_evict_takes_only_unpinned_childless_nodes_lru_first() -> None:
    tree = RadixTree(B)
    root = ("ns", "fp")
    a = [tree.insert(root, None, np.arange(B), b"a", 10)]
    a.append(tree.insert(root, b"a", np.arange(B, 2 * B), b"a2", 10))
    tree.insert(root, None, np.full(B, 9), b"b", 10)
    tree.pin([tree.get(b"b")])  # type: ignore[list-item]
    tree.match(root, np.arange(2 * B))  # a and a2 are the most recent now, but b is pinned
    evicted = [n.key for n in tree.evict(1000)]
    assert evicted == [b"a2", b"a"]  # the child first; the parent became a leaf after it
    assert childless(tree) == set(tree._leaf_nodes) == {b"b"}
