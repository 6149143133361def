"""Batched index walks (issue #40, item 7): how many leading lists a store holds whole, in one
lock and one walk, answering exactly as one lookup per list did.

The radix tree's walk against its own `match` on random trees; the store's `lookup_many`
against its `lookup`, on real LMDB, and across sidecars through a real Redis where the local
index ends. Over gRPC, LookupMany (SGLang's `batch_exists`) is tested in test_sglang_hicache.py.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import TINY, make_kv

from kvstore.config import StoreConfig
from kvstore.errors import InvalidInputError
from kvstore.store.tiered import TieredStore
from radix import RadixTree

B = 4
Array = np.ndarray[Any, Any]


def one_by_one(tree: RadixTree, lists: Array) -> int:
    """The reference: a match per row, stopping at the first row not held whole."""
    n = lists.shape[1]
    for index, row in enumerate(lists):
        if tree.match("r", row, touch=False).num_tokens < n:
            return index
    return len(lists)


def random_tree(rng: random.Random) -> tuple[RadixTree, list[Array]]:
    """A tree holding random prefixes of a few random token lists (short alphabet: shared edges)."""
    tree = RadixTree(B)
    rows = [np.array([rng.randrange(3) for _ in range(3 * B)], dtype=np.uint32) for _ in range(12)]
    for key, row in enumerate(rows):
        parent = None
        for block in range(rng.randrange(4)):  # 0 to 3 of the row's blocks
            edge = row[block * B : (block + 1) * B]
            match = tree.match("r", row[: (block + 1) * B], touch=False)
            if match.num_tokens > block * B:  # already there (a shared prefix)
                parent = match.nodes[-1].key
                continue
            node_key = f"{key}-{block}".encode()
            tree.insert("r", parent, edge, node_key, 1)
            parent = node_key
    return tree, rows


@pytest.mark.parametrize("seed", range(40))
def test_the_walk_answers_as_a_match_per_row(seed: int) -> None:
    rng = random.Random(seed)
    tree, rows = random_tree(rng)
    for width in (B, 2 * B, 3 * B, B + 1):  # B + 1: rows no block cuts are never whole
        picked = np.stack([rows[rng.randrange(len(rows))][:width] for _ in range(rng.randrange(1, 9))])
        assert tree.leading_whole("r", picked, touch=False) == one_by_one(tree, picked)
    assert tree.leading_whole("other-root", np.stack(rows)) == 0
    assert tree.leading_whole("r", np.empty((0, B), np.uint32)) == 0


def test_the_walk_refreshes_only_the_rows_held_whole() -> None:
    tree = RadixTree(B)
    a, b = np.arange(B, dtype=np.uint32), np.arange(B, 2 * B, dtype=np.uint32)
    tree.insert("r", None, a, b"a", 1)
    tree.insert("r", None, b, b"b", 1)
    tree.insert("r", b"b", a, b"ba", 1)  # row [b, b] holds its first block only
    before = {key: tree.get(key).last_access for key in (b"a", b"b", b"ba")}  # type: ignore[union-attr]
    rows = np.stack([np.concatenate([b, a]), np.concatenate([a, a])])  # whole, then half held
    assert tree.leading_whole("r", rows) == 1
    after = {key: tree.get(key).last_access for key in before}  # type: ignore[union-attr]
    assert after[b"b"] > before[b"b"] and after[b"ba"] > before[b"ba"] and after[b"a"] == before[b"a"]


def pages(count: int, tokens: int = 32) -> Array:
    return np.random.default_rng(7).integers(0, 50_000, (count, tokens)).astype(np.uint32)


def test_the_store_answers_as_its_lookups(tmp_path: Path) -> None:
    config = StoreConfig(data_dir=tmp_path / "d", block_tokens=16, chunk_tokens=8, memory_bytes=16 << 20)
    lists = pages(8)
    with TieredStore(config) as store:
        for i in (0, 1, 2, 4):
            store.store(lists[i], make_kv(TINY, 32, i), model=TINY)
        store.store(lists[5][:16], make_kv(TINY, 16, 5), model=TINY)  # half of list 5
        for order in ([0, 1, 2, 3], [4, 0, 1], [5, 0], [2, 1, 0, 4], [3]):
            expected = next(
                (k for k, i in enumerate(order) if store.lookup(lists[i], model=TINY).num_tokens < 32),
                len(order),
            )
            assert store.lookup_many(lists[order], model=TINY) == expected
        assert store.lookup_many(lists[:3], model=TINY, namespace="other") == 0
        with pytest.raises(InvalidInputError, match="token_lists"):
            store.lookup_many(lists[0], model=TINY)


def test_pages_put_in_the_remote_tier_by_another_sidecar_are_learned(tmp_path: Path, redis_url: str) -> None:
    prefix = f"many{random.randrange(1 << 30)}"
    lists = pages(4)
    common = {"block_tokens": 16, "chunk_tokens": 8, "memory_bytes": 16 << 20, "remote_url": redis_url}
    with TieredStore(StoreConfig(remote_prefix=prefix, **common)) as writer:  # type: ignore[arg-type]
        for i in range(3):
            writer.store(lists[i], make_kv(TINY, 32, i), model=TINY)
        assert writer.flush(30)
    with TieredStore(StoreConfig(data_dir=tmp_path / "d", remote_prefix=prefix, **common)) as reader:  # type: ignore[arg-type]
        assert reader.lookup_many(lists, model=TINY) == 3
