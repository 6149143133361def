"""A layered block's key summaries encoded off the Store's thread (issue #40, item 3).

Real LMDB under tmp_path. A long `commit_ms` holds the blocks in the write-behind backlog, so
the state between the acknowledgement and the commit can be looked at: memory holds each
block's pack (a full load is served), the summaries are not encoded yet, a query-aware load
encodes them itself, and the disk finally holds byte for byte what a synchronous Store writes.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import make_kv, make_tokens
from hostile import wait_until

from kvstore.config import StoreConfig
from kvstore.format.block_meta import BlockMeta
from kvstore.format.key_summary import decode_summary
from kvstore.model import ModelSpec
from kvstore.store.tiered import TieredStore

MODEL = ModelSpec("deferred-test", num_layers=3, num_kv_heads=2, head_dim=32)
N = 128  # tokens a prompt: 4 blocks of 32
Array = np.ndarray[Any, Any]


def config(data_dir: Path, **kw: object) -> StoreConfig:
    fields: dict[str, object] = {"block_tokens": 32, "layout": "layered", "memory_bytes": 64 << 20, **kw}
    return StoreConfig(data_dir=data_dir, **fields)


def blocks_of(store: TieredStore, tokens: Array, model: ModelSpec = MODEL) -> list[BlockMeta]:
    match = store.index.match(store._root(model, "default"), tokens, touch=False)
    return [node.payload for node in match.nodes]


def disk_records(store: TieredStore, meta: BlockMeta) -> list[bytes]:
    got = store.durable[0].get_chunks(meta, range(meta.num_chunks))
    assert all(x is not None for x in got)
    return [bytes(x) for x in got if x is not None]


def test_a_store_is_acknowledged_before_its_summaries_and_a_full_load_is_served(tmp_path: Path) -> None:
    tokens, kv = make_tokens(N, seed=1), make_kv(MODEL, N, seed=1)
    with TieredStore(config(tmp_path / "d", commit_ms=60_000)) as store:
        store.store(tokens, kv, model=MODEL)
        metas = blocks_of(store, tokens)
        assert len(metas) == 4 and store.writer.summaries.pending() == 4
        for meta in metas:  # the pack is held, the summaries are not yet
            assert store.memory.has_chunk(meta.key, meta.pack_index)
            assert not any(store.memory.has_chunk(meta.key, layer) for layer in range(MODEL.num_layers))
        covered, _, loaded = store.load_arrays(tokens, model=MODEL)
        assert covered == N and loaded.tobytes() == kv.tobytes()
        assert store.writer.summaries.pending() == 4  # a full load does not need them


def test_a_query_aware_load_encodes_pending_summaries_itself(tmp_path: Path) -> None:
    tokens, kv = make_tokens(N, seed=2), make_kv(MODEL, N, seed=2)
    with TieredStore(config(tmp_path / "sync", sync_stores=True)) as synced:
        synced.store(tokens, kv, model=MODEL)
        with synced.open_layers(tokens, model=MODEL) as load:
            expected = [load.key_summary(layer).copy() for layer in range(MODEL.num_layers)]
    with TieredStore(config(tmp_path / "behind", commit_ms=60_000)) as store:
        store.store(tokens, kv, model=MODEL)
        with store.open_layers(tokens, model=MODEL) as load:
            got = [load.key_summary(layer) for layer in range(MODEL.num_layers)]
        assert store.writer.summaries.pending() == 0
        for want, have in zip(expected, got, strict=True):
            assert have.tobytes() == want.tobytes()
        for meta in blocks_of(store, tokens):  # now in memory, beside the pack
            assert all(store.memory.has_chunk(meta.key, layer) for layer in range(MODEL.num_layers))
        assert store.durable[0].usage().num_blocks == 0  # and still not on disk


@pytest.mark.parametrize(
    ("dtype", "codec", "pack"),
    [
        ("float16", "raw", True),
        ("bfloat16", "shuffle-zstd", True),
        ("float32", "raw", False),
        ("float16", "shuffle-zstd", False),
    ],
)
def test_the_disk_gets_what_a_synchronous_store_writes_whatever_the_caller_did_to_its_buffer(
    tmp_path: Path, dtype: str, codec: str, pack: bool
) -> None:
    model = replace(MODEL, dtype=dtype)
    tokens, kv = make_tokens(N, seed=3), make_kv(model, N, seed=3)
    settings: dict[str, object] = {"codec": codec, "layered_pack": pack}
    with TieredStore(config(tmp_path / "sync", sync_stores=True, **settings)) as synced:
        synced.store(tokens, kv, model=model)
        want = {m.key: (m.nbytes, disk_records(synced, m)) for m in blocks_of(synced, tokens, model)}
    with TieredStore(config(tmp_path / "behind", commit_ms=60_000, **settings)) as store:
        buffer = kv.copy()
        store.store(tokens, buffer, model=model)
        buffer[...] = 0  # acknowledged: the caller's buffer is its own again (shm arenas are reused)
        assert store.flush(30)
        for meta in blocks_of(store, tokens, model):
            nbytes, records = want[meta.key]
            assert disk_records(store, meta) == records
            assert meta.nbytes == nbytes == sum(len(r) for r in records)
            summary = decode_summary(records[0], meta.chunk_id(0))
            assert summary.keys.codes.shape == (MODEL.num_kv_heads, 32, MODEL.head_dim)
        assert store.writer.summaries.pending() == 0


def test_blocks_memory_cannot_hold_are_written_through_whole(tmp_path: Path) -> None:
    tokens, kv = make_tokens(N, seed=4), make_kv(MODEL, N, seed=4)
    block_bytes = 32 * MODEL.num_layers * 2 * MODEL.num_kv_heads * MODEL.head_dim * 2
    cfg = config(tmp_path / "d", commit_ms=60_000, memory_bytes=2 * block_bytes)  # about one block
    with TieredStore(cfg) as store:
        store.store(tokens, kv, model=MODEL)
        assert store.writer.summaries.pending() <= 1
        on_disk = [m for m in blocks_of(store, tokens) if store.durable[0].contains(m.key)]
        assert len(on_disk) >= 3  # what memory could not take went to disk at once, summaries too
        for meta in on_disk:
            records = disk_records(store, meta)
            assert decode_summary(records[0], meta.chunk_id(0)).record_id == meta.chunk_id(0)
        covered, _, loaded = store.load_arrays(tokens, model=MODEL)
        assert covered == N and loaded.tobytes() == kv.tobytes()


def test_a_compressed_store_in_a_full_memory_is_acknowledged_from_memory(tmp_path: Path) -> None:
    """Memory holds raw records (a zstd block is bigger there than on disk) and room for the
    summaries to come: eviction of committed blocks makes room for both."""
    kv_bytes = MODEL.kv_shape(N)
    block_raw = int(np.prod(kv_bytes)) * 2 // 4 + 8192  # one block's KV and its records' headers
    cfg = config(tmp_path / "d", codec="shuffle-zstd", commit_ms=60_000, memory_bytes=6 * block_raw)
    with TieredStore(cfg) as store:
        for seed in range(10, 14):  # memory fills with committed, evictable blocks
            store.store(make_tokens(N, seed=seed), make_kv(MODEL, N, seed=seed), model=MODEL)
            assert store.flush(30)
        tokens, kv = make_tokens(N, seed=20), make_kv(MODEL, N, seed=20)
        store.store(tokens, kv, model=MODEL)
        assert store.writer.summaries.pending() == 4  # acknowledged from memory, not written through
        assert not any(store.durable[0].contains(m.key) for m in blocks_of(store, tokens))
        with store.open_layers(tokens, model=MODEL) as load:
            load.key_summary(0)
        covered, _, loaded = store.load_arrays(tokens, model=MODEL)
        assert covered == N and loaded.tobytes() == kv.tobytes()


def test_loads_racing_the_commit_all_get_the_summaries_of_a_synchronous_store(tmp_path: Path) -> None:
    """Query-aware loads on several threads reach blocks while the group commit encodes them: each
    block's summaries are encoded once and every load sees the same keys as a synchronous store."""
    prompts = [(make_tokens(N, seed=30 + i), make_kv(MODEL, N, seed=30 + i)) for i in range(6)]
    with TieredStore(config(tmp_path / "sync", sync_stores=True)) as synced:
        expected = []
        for tokens, kv in prompts:
            synced.store(tokens, kv, model=MODEL)
            with synced.open_layers(tokens, model=MODEL) as load:
                expected.append([load.key_summary(layer).tobytes() for layer in range(MODEL.num_layers)])
    with TieredStore(config(tmp_path / "behind", commit_ms=1)) as store:
        for tokens, kv in prompts:
            store.store(tokens, kv, model=MODEL)

        def read(i: int) -> list[bytes]:
            with store.open_layers(prompts[i][0], model=MODEL) as load:
                return [load.key_summary(layer).tobytes() for layer in range(MODEL.num_layers)]

        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(read, [i % len(prompts) for i in range(4 * len(prompts))]))
        assert store.flush(30) and store.writer.summaries.pending() == 0
        for i, keys in enumerate(got):
            assert keys == expected[i % len(prompts)]


def test_blocks_stored_while_a_commit_is_written_are_encoded_beside_it(tmp_path: Path) -> None:
    """The disk writer's pipeline: while a group commit is in its LMDB transaction (stalled here on
    the tier's own write lock), the blocks stored meanwhile get their summaries on the encoder
    thread; the commit after it finds them done, and the disk holds what a synchronous Store
    writes. Without the encoder they would wait for their own commit."""
    prompts = [(make_tokens(N, seed=40 + i), make_kv(MODEL, N, seed=40 + i)) for i in range(2)]
    with TieredStore(config(tmp_path / "sync", sync_stores=True)) as synced:
        for tokens, kv in prompts:
            synced.store(tokens, kv, model=MODEL)
        want = {m.key: disk_records(synced, m) for tokens, _ in prompts for m in blocks_of(synced, tokens)}
    with TieredStore(config(tmp_path / "behind", commit_blocks=4, commit_ms=60_000)) as store:
        disk = store.durable[0]
        with disk._write_lock:  # type: ignore[attr-defined]  # the first commit waits in put_blocks
            store.store(*prompts[0], model=MODEL)  # 4 blocks: a full batch, committed at once
            assert wait_until(lambda: store.writer.summaries.pending() == 0)  # by the commit itself
            store.store(*prompts[1], model=MODEL)
            assert wait_until(lambda: store.writer.summaries.pending() == 0)  # by the encoder
            assert disk.usage().num_blocks == 0 and store.stats().get("disk_backlog_blocks") == 8
        assert store.flush(30)
        for tokens, _ in prompts:
            for meta in blocks_of(store, tokens):
                assert disk_records(store, meta) == want[meta.key]


def test_no_summary_is_encoded_ahead_while_no_commit_is_under_way(tmp_path: Path) -> None:
    with TieredStore(config(tmp_path / "d", commit_blocks=64, commit_ms=60_000)) as store:
        for seed in (50, 51):
            store.store(make_tokens(N, seed=seed), make_kv(MODEL, N, seed=seed), model=MODEL)
        assert not wait_until(lambda: store.writer.summaries.pending() < 8, timeout_s=0.5)
        assert store.flush(30) and store.writer.summaries.pending() == 0
