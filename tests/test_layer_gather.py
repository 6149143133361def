"""Gathered reads of a layer's chosen chunks over a whole prefix (kvstore/load/layer_gather.py).

Real LMDB, real files. What is checked: the runs a choice makes; a layer's chunks come bit-exact
from the packs memory holds (nothing read from disk) and, on a restarted store, by offset from the
data file (a header per touched block and the chunks, nothing else, in one parallel submission);
a chunk corrupted on disk is refused and its block forgotten, as the per-block path does; the
speculative hint names only what the disk serves; the span reader fills scattered buffers and reads
what the page cache lacks of a span from where the cache's part ended; a cold load's summaries of
every block memory lacks come from the disk in one call.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import TINY, corrupt_chunk, make_kv, make_tokens

from kvstore.config import StoreConfig
from kvstore.errors import ChecksumError
from kvstore.format.layer_record import header_bytes
from kvstore.load.layer_gather import plan_runs
from kvstore.store.tiered import TieredStore
from kvstore.tiers.disk.spans import SpanReads

B, C = 32, 8  # block tokens; tokens per per-layer chunk
N = 4 * B
PER = B // C  # chunks per block and layer
Array = np.ndarray[Any, Any]


def _config(data_dir: Path) -> StoreConfig:
    return StoreConfig(
        data_dir=data_dir, block_tokens=B, chunk_tokens=8, memory_bytes=64 << 20, layout="layered",
        layer_chunk_tokens=C,
    )  # fmt: skip


def _chunk_major(kv: Array, layer: int, chosen: Array) -> Array:
    """The stored KV of `chosen` chunks of `layer`, as `read_chunks` lays it out."""
    per_chunk = kv[layer].reshape(2, TINY.num_kv_heads, N // C, C, TINY.head_dim)
    return per_chunk[:, :, chosen].transpose(2, 0, 1, 3, 4)


def test_a_choice_becomes_runs_of_adjacent_chunks_of_one_block() -> None:
    runs = plan_runs(np.array([0, 1, 2, 3, 4, 6, 7, 13]), chunks_per_block=4)
    # 0-3 fill block 0; 4 starts block 1 (adjacent numbers, another block: a run of its own)
    assert runs.block.tolist() == [0, 1, 1, 3]
    assert runs.first.tolist() == [0, 0, 2, 1]
    assert runs.length.tolist() == [4, 1, 2, 1]
    assert runs.slot.tolist() == [0, 4, 5, 7]
    assert runs.num_chunks == 8 and runs.blocks().tolist() == [0, 1, 3]
    assert plan_runs(np.zeros(0, np.int64), 4).num_chunks == 0


def test_memory_serves_a_layer_in_one_gathered_read_bit_exact(tmp_path: Path) -> None:
    toks, kv = make_tokens(N, seed=1), make_kv(TINY, N, seed=1)
    chosen = np.array([0, 3, 5, 6, 7, 9, 14, 15])  # every block, runs of 1-3 chunks
    with TieredStore(_config(tmp_path)) as store:
        store.store(toks, kv, model=TINY)
        before = dict(store.stats().counters)
        with store.open_layers(toks, model=TINY) as load:
            got = load.read_chunks(1, chosen)
            np.testing.assert_array_equal(got.kv, _chunk_major(kv, 1, chosen))
            expected = (chosen[:, None] * C + np.arange(C)).reshape(-1)
            np.testing.assert_array_equal(got.positions, expected)
            chunk_bytes = TINY.token_bytes // TINY.num_layers * C
            assert load.bytes_read == len(chosen) * chunk_bytes  # no header: memory is trusted
            np.testing.assert_array_equal(load.read_layer(1, chosen).kv, kv[1][:, :, expected])
            assert load.hint_layer(0, chosen) == 0  # memory needs no read-ahead
        after = store.stats().counters
        assert after.get("bytes_read.lmdb", 0) == before.get("bytes_read.lmdb", 0)
        assert after["gathered_chunks.memory"] - before.get("gathered_chunks.memory", 0) == 2 * len(chosen)
        assert after["bytes_read.memory"] - before.get("bytes_read.memory", 0) >= load.bytes_read


def test_a_restarted_store_reads_a_layer_by_offset_from_the_data_file(tmp_path: Path) -> None:
    toks, kv = make_tokens(N, seed=2), make_kv(TINY, N, seed=2)
    with TieredStore(_config(tmp_path)) as store:
        store.store(toks, kv, model=TINY)
    chosen = np.array([1, 2, 4, 10, 12, 13])  # blocks 0, 1, 2, 3
    with TieredStore(_config(tmp_path)) as store:  # memory is empty: the disk serves every block
        with store.open_layers(toks, model=TINY) as load:
            assert load.hint_layer(1, chosen) == len(chosen)  # every chunk is the disk's
            got = load.read_chunks(1, chosen)
            np.testing.assert_array_equal(got.kv, _chunk_major(kv, 1, chosen))
            chunk_bytes = TINY.token_bytes // TINY.num_layers * C
            assert load.bytes_read == len(chosen) * chunk_bytes + 4 * header_bytes(PER)
            again = load.bytes_read
            np.testing.assert_array_equal(load.read_chunks(1, [5]).kv, _chunk_major(kv, 1, np.array([5])))
            assert load.bytes_read == again + chunk_bytes  # block 1's header was verified and kept
        assert store.stats().counters["gathered_chunks.lmdb"] == len(chosen) + 1  # by offset, all
        assert not any(store.memory.has_chunk(m.key, m.pack_index) for m in _metas(store, toks))


def test_a_chunk_corrupted_on_disk_is_refused_and_its_block_forgotten(tmp_path: Path) -> None:
    config = _config(tmp_path)
    toks, kv = make_tokens(N, seed=3), make_kv(TINY, N, seed=3)
    with TieredStore(config) as store:
        store.store(toks, kv, model=TINY)
        second = _metas(store, toks)[1]
    corrupt_chunk(config, second.key, second.pack_index, offset=-5)  # layer 1's last chunk
    with TieredStore(config) as store:
        with store.open_layers(toks, model=TINY) as load:
            np.testing.assert_array_equal(load.read_chunks(0, [4]).kv, _chunk_major(kv, 0, np.array([4])))
            with pytest.raises(ChecksumError, match=second.key.hex()):
                load.read_chunks(1, [0, 7, 9])  # block 1's chunk 3 of layer 1: the flipped byte
        assert store.stats().counters["checksum_failures"] == 1
        assert store.index.tree.get(second.key) is None  # forgotten, as a corrupt record always is


def test_summaries_asked_out_of_order_from_disk_lose_nothing(tmp_path: Path) -> None:
    """Layer 1 asked before layer 0 (which starts the reader thread, which reads layer 1 again):
    a record handed out once is read again, never taken for one no tier holds."""
    toks, kv = make_tokens(N, seed=5), make_kv(TINY, N, seed=5)
    with TieredStore(_config(tmp_path)) as store:
        store.store(toks, kv, model=TINY)
    with TieredStore(_config(tmp_path)) as store:  # memory empty: summaries come from the disk
        with store.open_layers(toks, model=TINY) as load:
            first = load.packed_summary(1)
            load.packed_summary(0)
            again = load.packed_summary(1)  # from the reader thread, read a second time
            np.testing.assert_array_equal(again.codes, first.codes)
        assert store.stats().counters.get("chunk_misses", 0) == 0
        assert store.lookup(toks, model=TINY).num_tokens == N  # no block forgotten


def test_the_span_reader_fills_scattered_buffers_in_parallel(tmp_path: Path) -> None:
    data = np.random.default_rng(4).integers(0, 256, 1 << 20, dtype=np.uint8)
    path = tmp_path / "file"
    path.write_bytes(data.tobytes())
    fd = os.open(path, os.O_RDONLY)
    reads = SpanReads(fd, threads=3)
    try:
        for cold in (True, False):
            if cold:  # out of the page cache: the pool reads it (clean pages can be dropped)
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            before = reads.uncached
            out = np.zeros(64 * 100, np.uint8)
            heads = [bytearray(7) for _ in range(32)]
            spans = [(i * 4099, [memoryview(heads[i]), out[i * 100 : (i + 1) * 100].data]) for i in range(32)]
            spans += [(len(data) - 10, [out[6000:6050].data])]  # past the end: a short read
            done = reads.read(spans)
            assert done[:32] == [107] * 32 and done[32] == 10
            for i in range(32):
                assert bytes(heads[i]) == data[i * 4099 : i * 4099 + 7].tobytes()
                assert out[i * 100 : (i + 1) * 100].tobytes() == data[i * 4099 + 7 : i * 4099 + 107].tobytes()
            # cold: some read waited for the disk (dropping pages is advice the kernel may take in
            # part); warm: all from the page cache on this thread, but the short read at the end,
            # which is not held whole
            assert reads.uncached > before + 1 if cold else reads.uncached == before + 1
    finally:
        reads.close()
        os.close(fd)
    with pytest.raises(OSError, match="closed"):
        reads.read(spans * 2)


def test_a_span_the_page_cache_holds_in_part_is_read_on_from_there_never_twice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = np.random.default_rng(6).integers(0, 256, 4 << 20, dtype=np.uint8)
    path = tmp_path / "file"
    path.write_bytes(data.tobytes())
    fd = os.open(path, os.O_RDONLY)
    reads, returned = SpanReads(fd, threads=2), []
    real = os.preadv

    def counted(fd: int, buffers: Any, offset: int, *flags: int) -> int:
        got = real(fd, buffers, offset, *flags)
        returned.append((offset, got))
        return got

    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.pread(fd, 1 << 20, 0)  # the first MiB in the page cache, the rest (mostly) not
        monkeypatch.setattr(os, "preadv", counted)
        out = np.zeros(4 << 20, np.uint8)
        assert reads.read([(0, [out[: 1 << 20].data, out[1 << 20 :].data])]) == [4 << 20]
        assert out.tobytes() == data.tobytes()
        cached = returned[0][1]  # RWF_NOWAIT: what the page cache held, from the start
        if cached == 4 << 20:
            pytest.skip("the page cache kept the whole file (dropping pages is advice)")
        # main read the span again from its start after a partial RWF_NOWAIT read
        assert returned[1][0] == cached and sum(got for _, got in returned) == 4 << 20
    finally:
        reads.close()
        os.close(fd)


def test_a_cold_load_reads_the_summaries_of_every_block_memory_lacks_in_one_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Block after block, the first layer's summaries waited for one disk read per block in turn
    (~100 ms of a cold 4,096-token 8B-shaped load): the disk tier now reads them all at once,
    in parallel, but those of blocks memory holds."""
    from kvstore.tiers.disk.lmdb import LmdbTier

    toks, kv = make_tokens(N, seed=8), make_kv(TINY, N, seed=8)
    with TieredStore(_config(tmp_path)) as store:
        store.store(toks, kv, model=TINY)
        with store.open_layers(toks, model=TINY) as load:
            warm = [load.packed_summary(layer) for layer in range(TINY.num_layers)]
    calls: list[list[int]] = []
    real = LmdbTier.get_many

    def watched(self: LmdbTier, requests: Any) -> Any:
        calls.append([len(indices) for _, indices in requests])
        return real(self, requests)

    monkeypatch.setattr(LmdbTier, "get_many", watched)
    with TieredStore(_config(tmp_path)) as store:  # restarted: every summary on disk only
        with store.open_layers(toks[: 2 * B], model=TINY) as load:
            load.packed_summary(0)  # blocks 0 and 1: promoted to memory when the load closes
        assert calls == [[TINY.num_layers] * 2]  # one call, every layer of both blocks (main: 2)
        calls.clear()
        with store.open_layers(toks, model=TINY) as load:
            cold = [load.packed_summary(layer) for layer in range(TINY.num_layers)]
        assert calls == [[TINY.num_layers] * 2]  # blocks 2 and 3 only: memory holds 0 and 1
        assert store.stats().counters.get("chunk_misses", 0) == 0
    for a, b in zip(warm, cold, strict=True):
        np.testing.assert_array_equal(a.codes, b.codes)
        np.testing.assert_array_equal(a.low, b.low)
        np.testing.assert_array_equal(a.step, b.step)


def _metas(store: TieredStore, toks: Array) -> list[Any]:
    return [n.payload for n in store.index.match(store._root(TINY, "default"), toks, touch=False).nodes]
