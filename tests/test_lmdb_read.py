"""Cold loads read LMDB values with pread (kvstore/tiers/disk/pread.py), still verified.

Real LMDB files under tmp_path: a restarted store (empty memory tier) loads from
disk through the pread path, a byte flipped in data.mdb is still caught by the
chunk checksum, and buffers that are not in the map are copied instead.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import make_kv, make_tokens

from kvstore.config import StoreConfig
from kvstore.errors import InvalidInputError
from kvstore.model import ModelSpec
from kvstore.store.tiered import TieredStore
from kvstore.tiers.disk.pread import MapReader, WarmRanges, find_mapping
from kvstore.tiers.jobs import JobThread

# 2 KiB per token: a chunk of 8 tokens is 16 KiB, stored in LMDB overflow pages.
WIDE = ModelSpec("test-wide", num_layers=4, num_kv_heads=2, head_dim=64)


def _config(tmp_path: Path) -> StoreConfig:
    return StoreConfig(data_dir=tmp_path / "data", block_tokens=32, chunk_tokens=8, memory_bytes=64 << 20)


def _ordered(stream: object) -> np.ndarray:
    positions, kv = stream.gather(WIDE)  # type: ignore[attr-defined]
    return np.asarray(kv[:, :, :, np.argsort(positions)])


def test_restarted_store_loads_every_block_from_disk_through_pread(tmp_path: Path) -> None:
    config, tokens, kv = _config(tmp_path), make_tokens(128), make_kv(WIDE, 128)
    with TieredStore(config) as store:
        store.store(tokens, kv, model=WIDE)
    with TieredStore(config) as store:
        stream = store.load(tokens, model=WIDE)
        loaded = _ordered(stream)
        assert store.durable[0]._reader.mapped  # type: ignore[attr-defined]
        assert stream.num_tokens == 128
        # a record read per block: its layer pack (the default layout); importance: its 4 chunks each
        assert store.stats().counters.get("chunk_hits.lmdb") == (4 if config.layout == "layered" else 16)
    assert np.array_equal(loaded, kv)


def test_flipped_payload_byte_in_data_file_fails_the_checksum(tmp_path: Path) -> None:
    config, tokens, kv = _config(tmp_path), make_tokens(64), make_kv(WIDE, 64)
    with TieredStore(config) as store:
        store.store(tokens, kv, model=WIDE)
    data_file = config.lmdb_dir / "data.mdb"  # type: ignore[operator]
    raw = bytearray(data_file.read_bytes())
    # The second block's first chunk holds tokens 32..39 in order (no scores): find its payload.
    needle = np.ascontiguousarray(kv[:, :, :, 32:40]).tobytes()[:256]
    at = raw.find(needle)
    assert at > 0 and raw.find(needle, at + 1) == -1
    raw[at + 100] ^= 0x10
    data_file.write_bytes(bytes(raw))
    with TieredStore(config) as store:
        stream = store.load(tokens, model=WIDE)
        chunks = list(stream)
        assert stream.num_tokens == 32  # the corrupt second block ends the prefix
        assert sum(len(c.positions) for c in chunks) == 32
        assert store.stats().counters.get("checksum_failures") == 1


def test_buffers_outside_the_map_are_copied(tmp_path: Path) -> None:
    path = tmp_path / "file.bin"
    path.write_bytes(b"x" * 4096)
    reader = MapReader(path)
    try:
        views = reader.read([memoryview(b"abc"), None, bytearray(b"def")])
        assert [None if v is None else bytes(v) for v in views] == [b"abc", None, b"def"]
        assert all(v is None or v.readonly for v in views)
        assert not reader.mapped
    finally:
        reader.close()
    assert find_mapping(path.stat().st_ino, 0) is None


def test_hint_thread_runs_jobs_in_order_off_the_caller_and_close_joins_it() -> None:
    hints = JobThread("kvsieve-readahead-test")
    release, both_ran = threading.Event(), threading.Event()
    ran: list[tuple[int, str]] = []
    hints.submit(lambda: (release.wait(5), ran.append((0, threading.current_thread().name))))
    hints.submit(lambda: (ran.append((1, threading.current_thread().name)), both_ran.set()))
    assert ran == []  # submit returned while the first job still waits: the caller is never held
    release.set()
    assert both_ran.wait(5)
    hints.close()
    assert [i for i, _ in ran] == [0, 1]
    assert {name for _, name in ran} == {"kvsieve-readahead-test"}
    assert not any(t.name == "kvsieve-readahead-test" for t in threading.enumerate())
    hints.submit(lambda: ran.append((2, "late")))  # after close: ignored, no thread started
    assert len(ran) == 2


def test_a_failing_hint_does_not_stop_the_next_and_close_drops_queued_ones() -> None:
    hints = JobThread("kvsieve-readahead-test2")
    ran: list[int] = []
    release, second_ran, third_started = threading.Event(), threading.Event(), threading.Event()

    def failing() -> None:
        raise RuntimeError("a hint that fails")

    hints.submit(failing)
    hints.submit(lambda: (ran.append(1), second_ran.set()))
    assert second_ran.wait(5)  # the failure ended only its own job
    hints.submit(lambda: (third_started.set(), release.wait(5), ran.append(2)))
    hints.submit(lambda: ran.append(3))  # queued behind a running job when close() comes
    assert third_started.wait(5)
    closer = threading.Thread(target=hints.close)
    closer.start()
    release.set()
    closer.join(10)
    assert not closer.is_alive()
    assert ran == [1, 2]  # the running job finished; the queued one was dropped


def test_prefetch_returns_at_once_and_close_waits_for_its_hints(tmp_path: Path) -> None:
    """A cold load's readahead runs on the tier's hint thread; closing the store joins it
    before LMDB closes (a transaction left open there would outlive the environment)."""
    config, tokens, kv = _config(tmp_path), make_tokens(256), make_kv(WIDE, 256)
    with TieredStore(config) as store:
        store.store(tokens, kv, model=WIDE)
    with TieredStore(config) as store:
        tier = store.durable[0]
        loaded = _ordered(store.load(tokens, model=WIDE))  # 8 blocks from disk: hints issued
        names = {t.name for t in threading.enumerate()}
        assert any(n.startswith("kvsieve-readahead") for n in names)
        tier.prefetch([])  # nothing to hint: no error
    assert np.array_equal(loaded, kv)
    assert not any(t.name.startswith("kvsieve-readahead") for t in threading.enumerate())


def test_restarted_store_reads_blocks_into_warm_ranges_the_memory_tier_keeps(tmp_path: Path) -> None:
    # A block's pack here is 64 KiB, below MIN_BYTES: lowered so that every block's read is warm.
    config, tokens, kv = _config(tmp_path), make_tokens(128), make_kv(WIDE, 128)
    with TieredStore(config) as store:
        store.store(tokens, kv, model=WIDE)
    with TieredStore(config) as store:
        reader = store.durable[0]._reader  # type: ignore[attr-defined]
        warm = reader.warm
        assert warm is not None  # the store gives its disk tier warm memory as large as its memory tier
        warm.MIN_BYTES = 1
        store.warm_reads(1 << 20)  # made on the read-ahead thread
        deadline = time.monotonic() + 10
        while warm.usage().segment_bytes < 1 << 20 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert warm.usage().segment_bytes >= 1 << 20 and warm.usage().used_bytes == 0
        loaded = _ordered(store.load(tokens, model=WIDE))
        assert np.array_equal(loaded, kv)
        # every block's read landed in the arena, and the memory tier holds those very bytes
        assert warm.usage().used_bytes > 0
        loaded_again = _ordered(store.load(tokens, model=WIDE))
        assert store.stats().counters.get("chunk_hits.memory", 0) > 0
    assert np.array_equal(loaded_again, kv)


def test_warm_ranges_come_only_from_segments_made_ahead(tmp_path: Path) -> None:
    warm = WarmRanges(4 << 20, segment_bytes=1 << 20)
    try:
        warm.MIN_BYTES = 1
        assert warm.take(4096) is None  # nothing made yet: the read goes to fresh memory ...
        deadline = time.monotonic() + 10  # ... and a segment is made ahead meanwhile
        while warm.usage().segment_bytes == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        first = warm.take(4096)
        assert first is not None and first.flags.writeable and not first.any()
        warm.keep_ahead(8 << 20)  # more than the capacity: segments up to it, no further
        while warm.usage().segment_bytes < 4 << 20 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.05)
        assert warm.usage().segment_bytes == 4 << 20
        assert warm.take(2 << 20) is None  # larger than a segment: never warm
    finally:
        warm.close()


def test_a_read_into_a_warm_range_is_read_only_and_bit_exact(tmp_path: Path) -> None:
    path = tmp_path / "f.bin"
    data = np.random.default_rng(3).integers(0, 256, 3 << 20, dtype=np.uint8)
    path.write_bytes(data.tobytes())
    warm = WarmRanges(8 << 20, segment_bytes=4 << 20)
    try:
        warm.keep_ahead(4 << 20)
        deadline = time.monotonic() + 10
        while warm.usage().segment_bytes == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        reader = MapReader(path, warm)
        try:
            (view,) = reader.read([(4096, 2 << 20)])  # a (file offset, bytes) place
            assert view is not None and view.readonly
            assert bytes(view) == data[4096 : 4096 + (2 << 20)].tobytes()
            assert warm.usage().used_bytes == 2 << 20
            (short,) = reader.read([((3 << 20) - 100, 2 << 20)])  # past the end of the file: fewer bytes
            assert short is not None and bytes(short) == data[-100:].tobytes()
        finally:
            reader.close()
        del view, short
        assert warm.usage().used_bytes == 0  # both ranges back once their views are gone
    finally:
        warm.close()


def test_warm_reads_off_reads_into_fresh_memory_and_bad_values_are_refused(tmp_path: Path) -> None:
    config = dataclasses.replace(_config(tmp_path), warm_read_ahead_bytes=0)
    tokens, kv = make_tokens(64), make_kv(WIDE, 64)
    with TieredStore(config) as store:
        store.store(tokens, kv, model=WIDE)
    with TieredStore(config) as store:
        assert store.durable[0]._reader.warm is None  # type: ignore[attr-defined]
        store.warm_reads(1 << 20)  # nothing to make: no error either
        assert np.array_equal(_ordered(store.load(tokens, model=WIDE)), kv)
    for bad in (-1, 1.5, True, "128"):
        with pytest.raises(InvalidInputError, match="warm_read_ahead_bytes"):
            StoreConfig(memory_bytes=1 << 20, warm_read_ahead_bytes=bad)  # type: ignore[arg-type]


def test_big_values_are_located_by_their_nodes_without_touching_them(tmp_path: Path) -> None:
    """Every big value's place from its B-tree node (kvstore/tiers/disk/locate.py) is where the map
    puts it (py-lmdb's own `value()` touches every page of a value: a 32 MiB pack read whole just
    to be found), and a restarted store reads through the nodes once one agreed."""
    import lmdb

    from kvstore.tiers.disk.locate import node_span

    config, tokens, kv = _config(tmp_path), make_tokens(128), make_kv(WIDE, 128)
    with TieredStore(config) as store:
        store.store(tokens, kv, model=WIDE)
    assert config.lmdb_dir is not None
    env = lmdb.open(str(config.lmdb_dir), max_dbs=4, readonly=True, lock=False)
    reader = MapReader(config.lmdb_dir / "data.mdb")
    try:
        page = env.stat()["psize"]
        with env.begin(db=env.open_db(b"chunks", create=False), buffers=True) as txn:
            checked = 0
            for key, value in txn.cursor():
                span = node_span(key, page)
                if len(value) > page:  # an overflow value: its node says where it lies
                    assert span == reader.file_span(value, len(value))
                    checked += 1
                else:
                    assert span is None  # held inline in its leaf
        assert checked >= 4
    finally:
        reader.close()
        env.close()
    with TieredStore(config) as store:  # restarted: every block read from disk, by its node
        with store.load(tokens, model=WIDE) as stream:
            np.testing.assert_array_equal(_ordered(stream), kv)
        assert store.durable[0]._nodes.agrees is True  # type: ignore[attr-defined]


def test_several_blocks_values_are_read_ahead_a_block_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Locating a block's 32 summaries faulted in each one's first page, one random 4 KiB read each
    (2,048 at 16k tokens of an 8B shape): `get_many` of several blocks now has the kernel read each
    block's run of values at once, from its first value's place, and the run covers all of them."""
    model = ModelSpec("test-summaries", num_layers=4, num_kv_heads=8, head_dim=128)  # 64 KiB summaries
    config = StoreConfig(data_dir=tmp_path / "data", block_tokens=256, memory_bytes=256 << 20)
    tokens, kv = make_tokens(1024), make_kv(model, 1024)
    with TieredStore(config) as store:
        store.store(tokens, kv, model=model)
    with TieredStore(config) as store:
        disk = store.durable[0]
        metas = [
            n.payload for n in store.index.match(store._root(model, "default"), tokens, touch=False).nodes
        ]
        hinted: list[tuple[int, int]] = []
        monkeypatch.setattr(disk._reader, "will_need", hinted.extend)  # type: ignore[attr-defined]
        requests = [(m, [m.record_index(layer) for layer in range(model.num_layers)]) for m in metas]
        got = disk.get_many(requests)  # type: ignore[attr-defined]
        runs = list(hinted)
        assert len(runs) == len(metas) == 4  # one run a block
        for (meta, indices), (start, nbytes), values in zip(requests, runs, got, strict=True):
            for offset, size in disk.value_spans([(meta, i) for i in indices]):  # type: ignore[attr-defined]
                assert start <= offset and offset + size <= start + nbytes  # the run covers every value
            assert [bytes(v) for v in values] == [bytes(v) for v in disk.get_chunks(meta, indices)]
        hinted.clear()
        disk.get_many(requests[:1])  # type: ignore[attr-defined]
        assert hinted == []  # one block: a load's own reads ahead cover it
