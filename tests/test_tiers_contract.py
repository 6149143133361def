"""One contract suite over every tier: memory, LMDB on tmp_path, a real Redis and a real Redis Cluster."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvstore.errors import TierFullError
from kvstore.format.block_meta import BlockMeta
from kvstore.format.chunk import ChunkId, encode_chunk
from kvstore.keys import ROOT_KEY, block_key
from kvstore.tiers import create_tier
from kvstore.tiers.arena import HostArena
from kvstore.tiers.base import Tier

FP, NS = b"f" * 16, b"n" * 16


def make_block(
    key_byte: int, num_chunks: int = 4, chunk_tokens: int = 2, layout: int = 0
) -> tuple[BlockMeta, list[bytes]]:
    n = num_chunks * chunk_tokens
    tokens = np.arange(n, dtype=np.uint32) + 1000 * key_byte  # distinct content per key_byte
    key = block_key(ROOT_KEY, tokens, FP, NS)  # a real key: every read checks it
    rng = np.random.default_rng(key_byte)
    chunks = []
    for i in range(num_chunks):
        positions = np.arange(i * chunk_tokens, (i + 1) * chunk_tokens)
        kv = rng.standard_normal((1, 2, 1, chunk_tokens, 4)).astype(np.float16)
        chunks.append(encode_chunk(ChunkId(FP, NS, key, layout, i), positions, kv, "float16"))
    meta = BlockMeta(
        key, ROOT_KEY, FP, NS, 0, tokens, chunk_tokens, layout,
        np.arange(n), None, sum(len(c) for c in chunks), time.time(), "ns",
    )  # fmt: skip
    return meta, chunks


REDIS = pytest.mark.redis  # these two need redis-server


@pytest.fixture(
    params=[
        "memory",
        "memory-arena",
        "lmdb",
        pytest.param("redis", marks=REDIS),
        pytest.param("redis-cluster", marks=REDIS),
    ]
)
def tier(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Tier]:
    if request.param == "memory":
        t = create_tier("memory", capacity_bytes=1 << 20)
    elif request.param == "memory-arena":  # records carved from segments (pinned where CUDA is)
        t = create_tier(
            "memory", capacity_bytes=1 << 20, arena=HostArena(2 << 20, pin=False, segment_bytes=1 << 16)
        )
    elif request.param == "lmdb":
        t = create_tier("lmdb", path=tmp_path / "lmdb")
    elif request.param == "redis":
        url = request.getfixturevalue("redis_url")
        t = create_tier("redis", url=url, prefix=f"test-{uuid.uuid4().hex}")
    else:
        nodes = request.getfixturevalue("redis_cluster").addresses
        t = create_tier("redis", nodes=nodes, prefix=f"test-{uuid.uuid4().hex}")
    yield t
    t.close()


def test_put_then_get_returns_the_same_bytes(tier: Tier) -> None:
    meta, chunks = make_block(1)
    tier.put_block(meta, chunks)
    got = tier.get_chunks(meta, [0, 1, 2, 3])
    assert [bytes(g) for g in got if g is not None] == chunks


def test_get_subset_and_missing(tier: Tier) -> None:
    meta, chunks = make_block(2)
    tier.put_block(meta, chunks)
    got = tier.get_chunks(meta, [3, 1])
    assert [bytes(g) if g else None for g in got] == [chunks[3], chunks[1]]
    absent, _ = make_block(3)
    assert tier.get_chunks(absent, [0]) == [None]


def test_get_ranges_returns_exactly_those_bytes(tier: Tier) -> None:
    meta, chunks = make_block(2)
    tier.put_block(meta, chunks)
    whole = chunks[2]
    spans = [(0, 10), (10, 11), (len(whole) - 8, len(whole)), (5, 5), (len(whole) - 3, len(whole) + 50)]
    got = tier.get_ranges(meta, 2, spans)
    assert got is not None and [bytes(g) for g in got] == [whole[a:b] for a, b in spans]
    assert tier.get_ranges(meta, 9, [(0, 4)]) is None  # no such record
    other, _ = make_block(3)
    assert tier.get_ranges(other, 0, [(0, 4)]) is None  # no such block
    moved = meta.with_layout(meta.layout_version + 1, meta.permutation, meta.nbytes)
    assert tier.get_ranges(moved, 2, [(0, 4)]) is None  # another layout version


def test_contains_meta_and_delete(tier: Tier) -> None:
    meta, chunks = make_block(4)
    assert not tier.contains(meta.key)
    assert tier.get_meta(meta.key) is None
    tier.put_block(meta, chunks)
    assert tier.contains(meta.key)
    stored = tier.get_meta(meta.key)
    assert stored is not None and stored.key == meta.key and stored.tokens.tolist() == meta.tokens.tolist()
    assert tier.delete_block(meta.key) == meta.nbytes
    assert not tier.contains(meta.key)
    assert tier.get_chunks(meta, [0]) == [None]
    assert tier.delete_block(meta.key) == 0


def test_usage_tracks_puts_and_deletes(tier: Tier) -> None:
    a, ca = make_block(5)
    b, cb = make_block(6, num_chunks=2)
    tier.put_block(a, ca)
    tier.put_block(b, cb)
    usage = tier.usage()
    assert (usage.used_bytes, usage.num_blocks, usage.num_chunks) == (a.nbytes + b.nbytes, 2, 6)
    tier.delete_block(a.key)
    usage = tier.usage()
    assert (usage.used_bytes, usage.num_blocks, usage.num_chunks) == (b.nbytes, 1, 2)


def test_replacing_a_block_does_not_double_count(tier: Tier) -> None:
    meta, chunks = make_block(7)
    tier.put_block(meta, chunks)
    tier.put_block(meta, chunks)
    assert tier.usage().used_bytes == meta.nbytes
    assert tier.usage().num_blocks == 1


def test_iter_meta_lists_every_block(tier: Tier) -> None:
    for key_byte in (8, 9, 10):
        tier.put_block(*make_block(key_byte))
    assert sorted(int(m.tokens[0]) // 1000 for m in tier.iter_meta()) == [8, 9, 10]


def test_other_layout_version_is_not_returned(tier: Tier) -> None:
    meta, chunks = make_block(11, layout=0)
    tier.put_block(meta, chunks)
    newer, _ = make_block(11, layout=1)
    assert tier.get_chunks(newer, [0]) == [None]


def test_put_blocks_stores_every_block(tier: Tier) -> None:
    blocks = [make_block(50), make_block(51, num_chunks=2)]
    tier.put_blocks(blocks)
    for meta, chunks in blocks:
        assert [bytes(c) for c in tier.get_chunks(meta, range(len(chunks))) if c] == chunks
    assert (tier.usage().num_blocks, tier.usage().num_chunks) == (2, 6)


def test_put_blocks_replaces_without_double_counting(tier: Tier) -> None:
    meta, chunks = make_block(52)
    tier.put_blocks([(meta, chunks)])
    tier.put_blocks([(meta, chunks), make_block(53)])
    assert tier.usage().num_blocks == 2
    assert tier.usage().used_bytes == meta.nbytes + make_block(53)[0].nbytes


@pytest.mark.parametrize("kind", ["memory", "lmdb"])
def test_put_blocks_that_do_not_fit_keep_nothing(kind: str, tmp_path: Path) -> None:
    first, c_first = make_block(54, num_chunks=1)
    if kind == "memory":
        tier = create_tier("memory", capacity_bytes=first.nbytes + 10)
        big = [bytes(first.nbytes)]
    else:
        tier = create_tier("lmdb", path=tmp_path / "l", capacity_bytes=1 << 20)  # 64 MiB map
        big = [bytes(80 << 20)]
    second, _ = make_block(55, num_chunks=1)
    with pytest.raises(TierFullError):
        tier.put_blocks([(first, c_first), (second, big)])
    assert tier.usage().num_blocks == 0 and not tier.contains(first.key)
    tier.close()


def test_memory_tier_never_evicts_by_itself() -> None:
    a, ca = make_block(12)
    b, cb = make_block(13)
    tier = create_tier("memory", capacity_bytes=a.nbytes + b.nbytes // 2)
    tier.put_block(a, ca)
    with pytest.raises(TierFullError, match="do not fit"):
        tier.put_block(b, cb)
    assert all(c is not None for c in tier.get_chunks(a, [0, 1, 2, 3]))  # the index decides, not the tier
    assert not tier.contains(b.key)


def test_lmdb_block_survives_reopen(tmp_path: Path) -> None:
    meta, chunks = make_block(16)
    t = create_tier("lmdb", path=tmp_path / "l")
    t.put_block(meta, chunks)
    t.close()
    t = create_tier("lmdb", path=tmp_path / "l")
    assert t.usage().num_blocks == 1
    assert [bytes(c) for c in t.get_chunks(meta, [0, 1, 2, 3]) if c] == chunks
    t.close()


def test_lmdb_map_grows_when_unbounded(tmp_path: Path) -> None:
    t = create_tier("lmdb", path=tmp_path / "g", initial_map_bytes=8 << 20)
    big = [bytes(5 << 20)]  # beyond the initial 8 MiB map after two puts
    for i in range(4):
        meta, _ = make_block(20 + i, num_chunks=1)
        t.put_block(meta, big)
    assert t.usage().num_blocks == 4
    t.close()


def test_lmdb_full_map_with_a_budget_is_a_clear_error(tmp_path: Path) -> None:
    t = create_tier("lmdb", path=tmp_path / "f", capacity_bytes=1 << 20)  # 64 MiB map
    meta, _ = make_block(30, num_chunks=1)
    with pytest.raises(TierFullError, match="full"):
        t.put_block(meta, [bytes(80 << 20)])
    assert t.usage().num_blocks == 0
    t.close()


def test_lmdb_reads_racing_map_growth_never_fail(tmp_path: Path) -> None:
    """Growing the map remaps the file: readers on other threads must wait, not fail."""
    t = create_tier("lmdb", path=tmp_path / "race", initial_map_bytes=1 << 20)
    meta, chunks = make_block(1, num_chunks=8, chunk_tokens=64)
    t.put_block(meta, chunks)
    stop = threading.Event()
    errors: list[str] = []
    reads = [0]

    def reader() -> None:
        while not stop.is_set():
            try:
                got = t.get_chunks(meta, range(8))
                assert [bytes(g) for g in got if g is not None] == chunks
                reads[0] += 1
            except Exception as exc:  # any failure is the bug under test
                errors.append(repr(exc))

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for thread in threads:
        thread.start()
    start_map = t._env.info()["map_size"]  # type: ignore[attr-defined]
    for i in range(48):  # ~24 MiB of blocks: the map doubles five times or more
        big_meta, _ = make_block(100 + i, num_chunks=1)
        t.put_block(big_meta, [bytes(512 << 10)])
    stop.set()
    for thread in threads:
        thread.join(timeout=30)
        assert not thread.is_alive()
    grown = t._env.info()["map_size"]  # type: ignore[attr-defined]
    t.close()
    assert grown >= 16 * start_map
    assert reads[0] > 0
    assert errors == []
