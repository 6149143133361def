"""Radix tree: exact matches at block boundaries, roots, pins and LRU eviction order."""

from __future__ import annotations

import numpy as np
import pytest

from radix import RadixTree

B = 4
ROOT = ("ns", "fp")


def build(tree: RadixTree, tokens: list[int], root: object = ROOT, nbytes: int = 10) -> list[bytes]:
    keys: list[bytes] = []
    parent = None
    for i in range(len(tokens) // B):
        key = f"{root}:{tokens[: (i + 1) * B]}".encode()
        tree.insert(root, parent, np.asarray(tokens[i * B : (i + 1) * B]), key, nbytes)
        keys.append(key)
        parent = key
    return keys


def test_match_is_block_aligned() -> None:
    tree = RadixTree(B)
    build(tree, list(range(12)))
    assert tree.match(ROOT, np.arange(12)).num_tokens == 12
    assert tree.match(ROOT, np.arange(11)).num_tokens == 8  # partial last block never matches
    diverged = np.arange(12)
    diverged[6] = 99
    assert tree.match(ROOT, diverged).num_tokens == 4
    assert tree.match(ROOT, np.arange(3)).num_tokens == 0


def test_divergent_prefixes_share_their_common_blocks() -> None:
    tree = RadixTree(B)
    a = build(tree, list(range(12)))
    b = build(tree, [*range(8), 50, 51, 52, 53])
    assert b[:2] == a[:2] and b[2] != a[2]  # the first two blocks are the same nodes
    fork = tree.get(b[2])
    assert fork is not None and fork.parent is tree.get(a[1]) is not None
    assert tree.num_blocks == 4  # 3 of a, 1 new of b
    assert [n.key for n in tree.match(ROOT, np.asarray([*range(8), 50, 51, 52, 53])).nodes] == [
        a[0],
        a[1],
        b[2],
    ]


def test_roots_are_separate() -> None:
    tree = RadixTree(B)
    build(tree, list(range(8)), root=("ns", "fp"))
    assert tree.match(("other-ns", "fp"), np.arange(8)).num_tokens == 0
    assert tree.match(("ns", "other-fp"), np.arange(8)).num_tokens == 0


def test_evict_removes_least_recently_used_leaves_first() -> None:
    tree = RadixTree(B)
    a = build(tree, [1] * 8)  # two blocks
    b = build(tree, [2] * 8)
    c = build(tree, [3] * 4)
    tree.match(ROOT, np.asarray([1] * 8))  # a is now the most recent
    removed = tree.evict(25)
    # Leaves by recency: b[1] (oldest), then c[0]; b[0] becomes a leaf once b[1] is gone
    # and is older than c[0].
    assert [n.key for n in removed] == [b[1], b[0], c[0]]
    assert tree.match(ROOT, np.asarray([1] * 8)).num_tokens == 8
    assert [n.key for n in tree.nodes()] == a


def test_pinned_blocks_and_their_ancestors_survive_eviction() -> None:
    tree = RadixTree(B)
    a = build(tree, [1] * 8)
    b = build(tree, [2] * 4)
    pin = tree.pin([tree.get(a[1])])  # type: ignore[list-item]
    removed = tree.evict(1000)
    assert [n.key for n in removed] == [b[0]]
    assert tree.match(ROOT, np.asarray([1] * 8)).num_tokens == 8
    tree.unpin(pin)
    assert {n.key for n in tree.evict(1000)} == set(a)
    assert tree.num_blocks == 0 and tree.total_bytes == 0


def test_pin_unknown_key_raises_and_pins_nothing() -> None:
    tree = RadixTree(B)
    a = build(tree, [1] * 4)
    gone = tree.get(a[0])
    assert gone is not None
    tree.remove(a[0])
    b = build(tree, [2] * 4)
    with pytest.raises(KeyError):
        tree.pin([tree.get(b[0]), gone])  # type: ignore[list-item]
    assert not tree.is_pinned(b[0])


def test_an_old_pin_never_releases_a_block_stored_again() -> None:
    tree = RadixTree(B)
    a = build(tree, [1] * 8)
    old = tree.pin(tree.match(ROOT, np.asarray([1] * 8)).nodes)
    tree.remove(a[1])  # dropped (a corrupt record) while pinned
    assert build(tree, [1] * 8) == a  # stored again: a new node under the same key
    new = tree.pin(tree.match(ROOT, np.asarray([1] * 8)).nodes)
    tree.unpin(old)  # the old holder ends
    tree.unpin(old)  # twice: still nothing more
    assert tree.is_pinned(a[0]) and tree.is_pinned(a[1])  # the new pin holds both
    assert tree.evict(1000) == [] and tree.num_blocks == 2
    tree.unpin(new)
    assert [n.key for n in tree.evict(1000)] == [a[1], a[0]]


def test_access_counts_and_remove_subtree() -> None:
    tree = RadixTree(B)
    a = build(tree, list(range(12)))
    tree.match(ROOT, np.arange(12))
    tree.match(ROOT, np.arange(4))
    counts = [tree.get(k).access_count for k in a]  # type: ignore[union-attr]
    assert counts == [2, 1, 1]
    removed = tree.remove(a[1])
    assert [n.key for n in removed] == [a[1], a[2]]
    assert tree.match(ROOT, np.arange(12)).num_tokens == 4


def test_insert_requires_known_parent_and_full_block() -> None:
    tree = RadixTree(B)
    with pytest.raises(KeyError):
        tree.insert(ROOT, b"nope", np.arange(4), b"k", 1)
    with pytest.raises(ValueError, match="block"):
        tree.insert(ROOT, None, np.arange(3), b"k", 1)
