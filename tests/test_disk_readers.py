"""The two readers of a layer-by-layer load's scattered spans (kvstore/tiers/disk/spans.py, uring.py).

Real files, a real io_uring ring where the kernel gives one, a real store. What is checked: each
reader fills scattered buffers bit-exact, cold and warm, a span past the file's end comes back
short; a span the page cache holds in part is read on from there; a failed read raises only after
every read in flight completed; a store told to use the ring serves a cold load through it
bit-exact; a reader that cannot be had, or is misspelt, is refused with an error naming it.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import TINY, make_kv, make_tokens, require_extra

from kvstore.config import DISK_READERS, StoreConfig
from kvstore.errors import InvalidInputError
from kvstore.store.tiered import TieredStore
from kvstore.tiers.disk import uring
from kvstore.tiers.disk.spans import SpanReads

READERS = ("threads", "io_uring")


def _need_ring() -> None:
    """Skip without the `uring` extra (fail under KVSIEVE_REQUIRE_URING=1), or where the kernel
    gives no ring (io_uring disabled, a seccomp filter): the refusal is tested below either way."""
    require_extra("uring")
    if not uring.ring_available():
        pytest.skip("the kernel gives no io_uring ring here")


@pytest.fixture
def data_file(tmp_path: Path) -> Iterator[tuple[int, np.ndarray[Any, Any]]]:
    data = np.random.default_rng(11).integers(0, 256, 4 << 20, dtype=np.uint8)
    path = tmp_path / "file"
    path.write_bytes(data.tobytes())
    fd = os.open(path, os.O_RDONLY)
    try:
        yield fd, data
    finally:
        os.close(fd)


@pytest.mark.parametrize("reader", READERS)
def test_each_reader_fills_scattered_buffers_bit_exact(
    reader: str, data_file: tuple[int, np.ndarray[Any, Any]]
) -> None:
    if reader == "io_uring":
        _need_ring()
    fd, data = data_file
    reads = SpanReads(fd, reader=reader)
    assert reads.kind == reader
    try:
        for cold in (True, False):
            if cold:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            out = np.zeros((200, 3000), np.uint8)
            heads = [bytearray(13) for _ in range(200)]
            offsets = [int(o) for o in np.random.default_rng(cold).choice(len(data) - 4000, 200)]
            spans = [(o, [memoryview(heads[i]), out[i].data]) for i, o in enumerate(offsets)]
            spans.append((len(data) - 7, [memoryview(bytearray(100))]))  # past the end: short
            done = reads.read(spans)
            assert done == [3013] * 200 + [7]
            for i, o in enumerate(offsets):
                assert bytes(heads[i]) == data[o : o + 13].tobytes()
                assert out[i].tobytes() == data[o + 13 : o + 3013].tobytes()
    finally:
        reads.close()
    with pytest.raises(OSError, match="closed"):
        reads.read(spans)


@pytest.mark.parametrize("reader", READERS)
def test_a_span_partly_in_the_page_cache_is_read_on_from_there(
    reader: str, data_file: tuple[int, np.ndarray[Any, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    if reader == "io_uring":
        _need_ring()
    fd, data = data_file
    reads = SpanReads(fd, reader=reader)
    cached: list[int] = []
    real = os.preadv

    def nowait_seen(fd: int, buffers: Any, offset: int, *flags: int) -> int:
        got = real(fd, buffers, offset, *flags)
        if flags:
            cached.append(got)
        return got

    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.pread(fd, 1 << 20, 0)  # the first MiB of each span's file in the page cache
        monkeypatch.setattr(os, "preadv", nowait_seen)
        out = np.zeros((2, 2 << 20), np.uint8)
        done = reads.read([(0, [out[0].data]), (1 << 20, [out[1].data])])
        assert done == [2 << 20, 2 << 20]
        np.testing.assert_array_equal(out[0], data[: 2 << 20])
        np.testing.assert_array_equal(out[1], data[1 << 20 : 3 << 20])
        assert cached and cached[0] >= 1 << 20  # the cache's part came from the calling thread
    finally:
        reads.close()


def test_a_failed_ring_read_raises_after_every_read_in_flight(tmp_path: Path) -> None:
    _need_ring()
    path = tmp_path / "w"
    path.write_bytes(b"x" * 65536)
    fd = os.open(path, os.O_WRONLY)  # reading it fails: EBADF for every read
    ring = uring.UringReads(fd, depth=4)
    try:
        buffers = [bytearray(4096) for _ in range(10)]
        with pytest.raises(OSError, match="reading the data file: Bad file descriptor"):
            ring.read([(i * 4096, [memoryview(b)]) for i, b in enumerate(buffers)])
        # nothing was left behind: no completion waits in the ring, and the next call's reads fail
        # on their own (a stale completion would have answered one of them)
        assert uring.liburing.io_uring_cq_ready(ring._ring) == 0
        with pytest.raises(OSError, match="Bad file descriptor"):
            ring.read([(0, [memoryview(buffers[0])])])
        assert uring.liburing.io_uring_cq_ready(ring._ring) == 0
    finally:
        ring.close()
        os.close(fd)


def test_a_store_told_to_use_the_ring_serves_a_cold_layer_by_layer_load_through_it(tmp_path: Path) -> None:
    _need_ring()
    config = StoreConfig(
        data_dir=tmp_path, block_tokens=32, chunk_tokens=8, memory_bytes=64 << 20, layout="layered",
        layer_chunk_tokens=8, disk_reader="io_uring",
    )  # fmt: skip
    n = 4 * 32
    toks, kv = make_tokens(n, seed=3), make_kv(TINY, n, seed=3)
    with TieredStore(config) as store:
        store.store(toks, kv, model=TINY)
    chosen = np.array([0, 2, 3, 5, 9, 10, 11, 15])  # runs of 1-3 chunks in every block
    with TieredStore(config) as store:  # restarted: the disk serves it
        spans = store.durable[0]._reader.spans  # type: ignore[attr-defined]
        assert spans.kind == "io_uring"
        with store.open_layers(toks, model=TINY) as load:
            for layer in range(TINY.num_layers):
                got = load.read_chunks(layer, chosen).kv
                per_chunk = kv[layer].reshape(2, TINY.num_kv_heads, n // 8, 8, TINY.head_dim)
                np.testing.assert_array_equal(got, per_chunk[:, :, chosen].transpose(2, 0, 1, 3, 4))
        assert store.stats().counters.get("gathered_chunks.lmdb", 0) > 0


def test_a_reader_misspelt_or_not_to_be_had_is_refused_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert DISK_READERS == ("threads", "io_uring")
    with pytest.raises(InvalidInputError, match="disk_reader must be one of threads, io_uring, got 'uring'"):
        StoreConfig(data_dir=tmp_path, disk_reader="uring")
    monkeypatch.setattr(uring, "liburing", None)
    monkeypatch.setattr(uring, "ring_available", lambda: False)
    config = StoreConfig(data_dir=tmp_path / "s", disk_reader="io_uring")
    with pytest.raises(InvalidInputError, match="io_uring: no ring can be had here"):
        TieredStore(config)
    assert not (tmp_path / "s").exists()  # refused before anything was made
    with TieredStore(dataclasses.replace(config, disk_reader="threads")) as store:
        assert store.durable[0]._reader.spans.kind == "threads"  # type: ignore[attr-defined]
