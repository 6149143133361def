"""A restarted store's full load into an arena copies each byte once, from the page cache.

Issue 47 item 4: after a restart the memory tier is empty, but the data file's pages are often
still in the page cache. A full load of packed blocks into a co-located client's shared-memory
arena then copies each block from LMDB's map straight into its slots of the arena
(kvstore/load/place.py): no `pread` of it into memory of ours, no array of its chunks in
between, and no promotion (the page cache holds it). Its records' checksum is checked over the
very pages just copied, so a pack changed in the page cache is caught, and no slot of it is
reported. Real LMDB files under tmp_path, a real `ServerArena`, the servicer's `ChunkWriter`,
and a real `kvsieve serve` for the wire.
"""

from __future__ import annotations

import mmap
import os
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import make_kv, make_tokens

from bench.common.sidecar import Sidecar
from kvstore._generated.kvsieve.v1 import kvsieve_pb2 as pb
from kvstore.client.kvclient import KVClient
from kvstore.config import StoreConfig
from kvstore.model import ModelSpec
from kvstore.rpc import shm
from kvstore.server.chunks import ChunkWriter
from kvstore.store.tiered import TieredStore
from kvstore.tiers.disk.resident import resident

# 2 KiB per token: a 32-token block's pack is 64 KiB and more, in LMDB overflow pages.
WIDE = ModelSpec("test-wide", num_layers=4, num_kv_heads=2, head_dim=64)
# 64 KiB per token: a block is 2 MiB, far above what a load allocates for itself.
DEEP = ModelSpec("test-deep", num_layers=32, num_kv_heads=8, head_dim=64)
BLOCK = 32
pytestmark = pytest.mark.skipif(not shm.available(), reason="no memfd or /proc")


def _config(tmp_path: Path, **extra: Any) -> StoreConfig:
    return StoreConfig(
        data_dir=tmp_path / "data", block_tokens=BLOCK, chunk_tokens=8, memory_bytes=64 << 20, **extra
    )


def _stored(tmp_path: Path, num_tokens: int, **extra: Any) -> tuple[StoreConfig, np.ndarray, np.ndarray]:
    """A store of `num_tokens` tokens, closed (its backlog committed), its data file read once so
    that the page cache holds it (as after a restart of the process alone)."""
    config, tokens, kv = _config(tmp_path, **extra), make_tokens(num_tokens), make_kv(WIDE, num_tokens)
    with TieredStore(config) as store:
        store.store(tokens, kv, model=WIDE)
    (config.lmdb_dir / "data.mdb").read_bytes()  # type: ignore[operator]
    return config, tokens, kv


class Reads:
    """Bytes read from files with pread/preadv while installed (every tier read goes through them)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.nbytes = 0
        for name in ("pread", "preadv"):
            monkeypatch.setattr(os, name, self._counted(getattr(os, name)))

    def _counted(self, read: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any) -> Any:
            got = read(*args)
            self.nbytes += got if isinstance(got, int) else len(got)
            return got

        return counted


def _load_into_arena(
    store: TieredStore, tokens: np.ndarray, model: ModelSpec = WIDE
) -> tuple[shm.ServerArena, list[pb.Chunk], Any]:
    """What the servicer does for a Load through an arena, by position: the chunk messages."""
    arena = shm.ServerArena.create(len(tokens) * model.token_bytes)
    stream = store.load(tokens, model=model)
    writer = ChunkWriter(stream, arena, model, packed_positions=True, by_position=True)
    chunks: list[pb.Chunk] = []
    try:
        while (batch := writer.next_batch(16, 64 << 20, 256)) is not None:
            chunks += pb.LoadResponse.FromString(batch).batch.chunks
    finally:
        writer.close()
    return arena, chunks, stream


def _arena_kv(arena: shm.ServerArena, num_tokens: int, model: ModelSpec = WIDE) -> np.ndarray:
    return np.array(shm.dense_view(arena.buf, model)[:, :, :, :num_tokens])


def test_a_restarted_store_copies_each_block_once_from_the_page_cache_into_the_arena(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config, tokens, kv = _stored(tmp_path, 4 * BLOCK)
    with TieredStore(config) as store:
        reads = Reads(monkeypatch)
        arena, chunks, stream = _load_into_arena(store, tokens)
        counters = store.stats().counters
        held = store.memory.usage().used_bytes
    assert reads.nbytes == 0  # nothing read with pread: every block copied from LMDB's map
    assert counters.get("in_place_reads") == 4
    assert counters.get("chunk_hits.lmdb") == 4 and counters.get("checksum_failures") is None
    assert held == 0  # not promoted: the page cache holds the blocks
    # One message per block, its slots its positions, the bytes in the arena exactly the stored KV.
    assert [(c.block_index, c.shm.slot, c.shm.num_tokens) for c in chunks] == [
        (i, i * BLOCK, BLOCK) for i in range(4)
    ]
    assert stream.num_tokens == stream.delivered_tokens == 4 * BLOCK
    assert np.array_equal(_arena_kv(arena, 4 * BLOCK, WIDE), kv)
    arena.close()


def test_no_buffer_of_a_blocks_size_is_made_between_the_page_cache_and_the_arena(tmp_path: Path) -> None:
    """The bytes of a block go from the map to the arena in one copy: nothing the size of a block
    is allocated on the way (main read each pack into memory, then copied it into an array of its
    chunks, then into the arena)."""
    config = _config(tmp_path)
    first, second = make_tokens(4 * BLOCK, seed=1), make_tokens(4 * BLOCK, seed=2)
    kv = make_kv(DEEP, 4 * BLOCK)
    with TieredStore(config) as store:
        for tokens in (first, second):
            store.store(tokens, kv, model=DEEP)
    (config.lmdb_dir / "data.mdb").read_bytes()  # type: ignore[operator]
    with TieredStore(config) as store:
        _load_into_arena(store, first, DEEP)[0].close()  # a first load's one-off costs
        tracemalloc.start()
        try:
            arena, _, stream = _load_into_arena(store, second, DEEP)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        in_place = store.stats().counters.get("in_place_reads")
    assert peak < stream.bytes_read // 4 // 8  # a block is 2 MiB: main allocated 2+ MiB per block
    assert in_place == 8
    assert np.array_equal(_arena_kv(arena, 4 * BLOCK, DEEP), kv)
    arena.close()


def test_a_pack_changed_in_the_page_cache_fails_after_the_copy_and_none_of_it_is_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config, tokens, kv = _stored(tmp_path, 4 * BLOCK)
    data_file = config.lmdb_dir / "data.mdb"  # type: ignore[operator]
    raw = bytearray(data_file.read_bytes())
    # Layer 0's first chunk of the third block, as a pack holds it: (2, heads, 8 tokens, dim).
    needle = np.ascontiguousarray(kv[0, :, :, 2 * BLOCK : 2 * BLOCK + 8]).tobytes()[:256]
    at = raw.find(needle)
    assert at > 0 and raw.find(needle, at + 1) == -1
    with open(data_file, "r+b") as fh:  # written through the page cache, as a bad disk or a bug would
        fh.seek(at + 100)
        fh.write(bytes([raw[at + 100] ^ 0x01]))
    with TieredStore(config) as store:
        reads = Reads(monkeypatch)
        arena, chunks, stream = _load_into_arena(store, tokens)
        counters = store.stats().counters
        after = store.lookup(tokens, model=WIDE).num_tokens
    assert reads.nbytes == 0  # the bad block too was checked in place, not read
    assert counters.get("checksum_failures") == 1 and counters.get("in_place_reads") == 2
    assert [c.block_index for c in chunks] == [0, 1]  # the bad block's slots are never reported
    assert stream.num_tokens == 2 * BLOCK and after == 2 * BLOCK  # the store forgot it
    assert np.array_equal(_arena_kv(arena, 2 * BLOCK, WIDE), kv[:, :, :, : 2 * BLOCK])
    arena.close()


def test_without_read_in_place_a_block_is_read_with_pread_and_promoted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config, tokens, kv = _stored(tmp_path, 4 * BLOCK, read_in_place=False)
    with TieredStore(config) as store:
        reads = Reads(monkeypatch)
        arena, chunks, stream = _load_into_arena(store, tokens)
        counters = store.stats().counters
        held = store.memory.usage().used_bytes
        arena_again, _, again = _load_into_arena(store, tokens)  # from the memory tier now
        counters_again = store.stats().counters
    assert reads.nbytes >= stream.bytes_read and counters.get("in_place_reads") is None
    assert held >= stream.bytes_read  # promoted
    assert len(chunks) == 4 and again.num_tokens == 4 * BLOCK
    assert counters_again.get("chunk_hits.memory") == 4
    assert np.array_equal(_arena_kv(arena, 4 * BLOCK, WIDE), kv)
    assert np.array_equal(_arena_kv(arena_again, 4 * BLOCK, WIDE), kv)
    arena.close()
    arena_again.close()


def test_resident_tells_pages_in_the_page_cache_from_pages_that_are_not(tmp_path: Path) -> None:
    path = tmp_path / "file"
    path.write_bytes(np.random.default_rng(0).integers(0, 255, 1 << 20, dtype=np.uint8).tobytes())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # clean and unmapped: dropped
        with mmap.mmap(fd, 1 << 20, prot=mmap.PROT_READ) as mapped:
            address = np.frombuffer(mapped, np.uint8).ctypes.data
            if resident(address, 1 << 20):
                pytest.skip("the kernel kept the file's pages (DONTNEED not honoured here)")
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no readahead: one page read is one page
            os.pread(fd, 4096, 4096)  # the second page only, read without the map
            assert resident(address + 4096, 4096)
            assert not resident(address, 4096) and not resident(address, 8192)
            os.pread(fd, 1 << 20, 0)
            assert resident(address + 100, (1 << 20) - 100)
    finally:
        os.close(fd)


@pytest.fixture
def restarted(tmp_path: Path) -> Iterator[tuple[Sidecar, np.ndarray, np.ndarray]]:
    sidecar = Sidecar(tmp_path / "sidecar").start()
    tokens, kv = make_tokens(4 * BLOCK, seed=3), make_kv(WIDE, 4 * BLOCK, seed=3)
    try:
        with KVClient(sidecar.address) as client:
            client.store(tokens, kv, model=WIDE)
        sidecar.terminate()  # commits the backlog; the page cache keeps the file
        sidecar.start()
        yield sidecar, tokens, kv
    finally:
        sidecar.kill()


def test_a_restarted_sidecar_loads_into_the_clients_arena_from_the_page_cache(
    restarted: tuple[Sidecar, np.ndarray, np.ndarray],
) -> None:
    sidecar, tokens, kv = restarted
    with KVClient(sidecar.address) as client:
        with client.load(tokens, model=WIDE) as stream:
            chunks = list(stream)
            assert stream.arena_view is not None
            assert all(np.shares_memory(c.kv, stream.arena_view) for c in chunks)
            assert [len(c.positions) for c in chunks] == [BLOCK] * 4  # one message per block
            got = np.concatenate([c.kv for c in chunks], axis=3)
        stats = client.stats()
    assert np.array_equal(got, kv)
    assert stats.get("in_place_reads") == 4 and not stats.get("chunk_hits.memory")
