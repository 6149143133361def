"""kvstore/events/view.py's TierView: router blocks shared by sibling blocks (same parent, same
first tokens), announced once and removed with their last holder, checked against the plain
rule (a count of holders per router hash) over random siblings held and released in random
order. No sockets: the view is what decides which events a subscriber gets."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest
from conftest import extra_installed, require_extra

if not extra_installed("events"):  # the view makes msgspec's events (kvstore/events/wire.py)
    require_extra("events")  # skips this module, or fails it under KVSIEVE_REQUIRE_EVENTS=1

from kvstore.events import hashing
from kvstore.events.view import TierView
from kvstore.format.block_meta import BlockMeta
from kvstore.keys import ROOT_KEY, block_key, namespace_digest

BLOCK, ROUTER = 64, 16  # four router blocks per stored block
pytestmark = pytest.mark.events
FINGERPRINT, NAMESPACE = b"f" * 16, namespace_digest("default")


def _meta(parent: bytes, depth: int, tokens: np.ndarray) -> BlockMeta:
    tokens = tokens.astype(np.uint32)
    key = block_key(parent, tokens, FINGERPRINT, NAMESPACE)
    permutation = np.arange(BLOCK)
    return BlockMeta(key, parent, FINGERPRINT, NAMESPACE, depth, tokens, 16, 1, permutation, None, 0, 0.0)


def _siblings(rng: random.Random, parent: bytes, depth: int) -> list[BlockMeta]:
    """Blocks under one parent whose tokens agree on their first 0..4 router blocks."""
    base = np.array([rng.randrange(50_000) for _ in range(BLOCK)])
    metas = []
    for _ in range(rng.randint(2, 6)):
        tokens = base.copy()
        tokens[rng.randrange(BLOCK // ROUTER) * ROUTER + rng.randrange(ROUTER) :] += rng.randint(1, 3)
        metas.append(_meta(parent, depth, tokens))
    return list({m.key: m for m in metas}.values())


@pytest.mark.parametrize("seed", range(20))
def test_shared_router_blocks_follow_their_holders(seed: int) -> None:
    rng = random.Random(seed)
    parent = _meta(ROOT_KEY, 0, np.arange(BLOCK))
    metas = _siblings(rng, ROOT_KEY, 0) + _siblings(rng, parent.key, 1)
    view = TierView("CPU", ROUTER, {})
    counts: Counter[int] = Counter()  # the plain rule: holders per router hash
    for meta in rng.sample(metas, len(metas)):
        hashes = hashing.router_hashes(meta, ROUTER)
        new = [h for h in hashes if counts[h] == 0]
        counts.update(hashes)
        event = view.hold(meta, hashes)
        assert (event.block_hashes if event else []) == new
        if event is not None:
            r = len(hashes) - len(new)
            assert event.token_ids == meta.tokens[r * ROUTER :].tolist()
            expected_parent = hashes[r - 1] if r else hashing.parent_hash(meta)
            assert event.parent_block_hash == expected_parent
        assert view.hold(meta, hashes) is None  # held already: nothing more
    for meta in rng.sample(metas, len(metas)):
        hashes = hashing.router_hashes(meta, ROUTER)
        counts.subtract(hashes)
        assert view.release(meta.key) == [h for h in hashes if counts[h] == 0]
        assert view.release(meta.key) == []


def test_router_hashes_are_the_documented_chain() -> None:
    """h[j] = xxh3_64(tokens of router block j as uint32 little-endian, seed=h[j-1]), seeded by
    the parent's key (or, at depth 0, by a hash of the namespace and the model); the last is
    the block's key: the values routers were given before stay the same."""
    import xxhash

    parent = _meta(ROOT_KEY, 0, np.arange(BLOCK) * 1000)
    child = _meta(parent.key, 1, np.arange(BLOCK) + 70_000)
    for meta, seed in (
        (parent, xxhash.xxh3_64_intdigest(NAMESPACE + FINGERPRINT)),
        (child, int.from_bytes(parent.key[:8], "big")),
    ):
        expected = []
        for j in range(BLOCK // ROUTER - 1):
            part = meta.tokens[j * ROUTER : (j + 1) * ROUTER].astype("<u4").tobytes()
            seed = xxhash.xxh3_64_intdigest(part, seed)
            expected.append(seed)
        expected.append(int.from_bytes(meta.key[:8], "big"))
        assert hashing.router_hashes(meta, ROUTER) == expected
        assert hashing.router_hashes(meta, BLOCK) == [expected[-1]]  # one router block: the key alone
