"""Disk tier: one LMDB environment under the data directory.

A block's chunks and its metadata are written in one write transaction, so a
process killed at any instant leaves either the whole block or none of it.
LMDB's copy-on-write B-tree with synchronous commits gives that without a journal
of our own. Reads keep readahead on: chunks are large values stored in
consecutive overflow pages, and cold reads measured 0.98 GB/s with readahead
against 83 MB/s without.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import lmdb

from kvstore.errors import ChecksumError
from kvstore.meta import BlockMeta
from kvstore.tiers.base import TierFullError, TierUsage, chunk_key

_MIN_MAP_BYTES = 64 << 20
_UNBOUNDED_MAP_BYTES = 1 << 30
# LMDB needs room beyond the payload: B-tree pages, and freed pages that a reader
# still sees cannot be reused at once.
_MAP_OVERHEAD = 2


class LmdbTier:
    """Blocks on disk in LMDB; see module docstring."""

    name = "lmdb"

    def __init__(
        self,
        path: str | os.PathLike[str],
        capacity_bytes: int | None = None,
        initial_map_bytes: int = _UNBOUNDED_MAP_BYTES,
    ) -> None:
        """Open (or create) the environment under `path`.

        Args:
            capacity_bytes: byte budget of chunk data; the map is sized from it.
                None = unbounded: the map starts at `initial_map_bytes` and doubles when full.
        """
        self._path = Path(path)
        self._initial_map = initial_map_bytes
        self._path.mkdir(parents=True, exist_ok=True)
        self._capacity = capacity_bytes
        self._growable = capacity_bytes is None
        self._env = lmdb.open(
            str(self._path),
            map_size=self._initial_map_size(),
            max_dbs=4,
            max_readers=512,
            readahead=True,
            sync=True,
            metasync=True,
        )
        self._chunks_db = self._env.open_db(b"chunks")
        self._blocks_db = self._env.open_db(b"blocks")
        self._write_lock = threading.Lock()
        self._used, self._num_blocks, self._num_chunks = self._scan_usage()

    @property
    def path(self) -> Path:
        """Directory of the LMDB environment."""
        return self._path

    def put_block(self, meta: BlockMeta, chunks: Sequence[bytes]) -> None:
        with self._write_lock:
            old = self._get_meta_raw(meta.key)
            for attempt in range(8):
                try:
                    with self._env.begin(write=True) as txn:
                        if old is not None:
                            self._delete_in_txn(txn, old)
                        for index, data in enumerate(chunks):
                            key = chunk_key(meta.key, meta.layout_version, index)
                            txn.put(key, data, db=self._chunks_db)
                        txn.put(meta.key, meta.to_bytes(), db=self._blocks_db)
                    break
                except lmdb.MapFullError as exc:
                    if not self._growable or attempt == 7:
                        raise TierFullError(f"LMDB map at {self._path} is full") from exc
                    self._env.set_mapsize(self._env.info()["map_size"] * 2)
            size = sum(len(c) for c in chunks)
            if old is not None:
                self._account(-old.nbytes, -1, -old.num_chunks)
            self._account(size, 1, len(chunks))

    def replace_layout(self, old: BlockMeta, new: BlockMeta, chunks: Sequence[bytes]) -> None:
        """Write a new layout of a block, switch its metadata, then drop the old chunks.

        Two transactions, so that a kill between them leaves the new layout in force
        and the old chunks as garbage that `sweep_orphans` removes; never a block
        whose metadata points at missing chunks. Mutates.
        """
        with self._write_lock, self._env.begin(write=True) as txn:
            for index, data in enumerate(chunks):
                txn.put(chunk_key(new.key, new.layout_version, index), data, db=self._chunks_db)
            txn.put(new.key, new.to_bytes(), db=self._blocks_db)
        with self._write_lock:
            with self._env.begin(write=True) as txn:
                for index in range(old.num_chunks):
                    txn.delete(chunk_key(old.key, old.layout_version, index), db=self._chunks_db)
            self._account(new.nbytes - old.nbytes, 0, 0)

    def put_meta(self, meta: BlockMeta) -> bool:
        with self._write_lock, self._env.begin(write=True, db=self._blocks_db) as txn:
            current = txn.get(meta.key)
            if current is None or BlockMeta.from_bytes(current).layout_version != meta.layout_version:
                return False
            txn.put(meta.key, meta.to_bytes())
            return True

    def get_chunks(self, meta: BlockMeta, indices: Sequence[int]) -> list[memoryview | None]:
        out: list[memoryview | None] = []
        with self._env.begin(db=self._chunks_db) as txn:
            for index in indices:
                data = txn.get(chunk_key(meta.key, meta.layout_version, index))
                out.append(None if data is None else memoryview(data))
        return out

    def get_meta(self, key: bytes) -> BlockMeta | None:
        return self._get_meta_raw(key)

    def contains(self, key: bytes) -> bool:
        with self._env.begin(db=self._blocks_db) as txn:
            return txn.get(key) is not None

    def delete_block(self, key: bytes) -> int:
        with self._write_lock:
            meta = self._get_meta_raw(key)
            if meta is None:
                return 0
            with self._env.begin(write=True) as txn:
                self._delete_in_txn(txn, meta)
            self._account(-meta.nbytes, -1, -meta.num_chunks)
            return meta.nbytes

    def delete_raw(self, key: bytes) -> None:
        """Delete a metadata record even if it does not parse (fsck --repair). Mutates."""
        with self._write_lock, self._env.begin(write=True) as txn:
            txn.delete(key, db=self._blocks_db)
            cursor = txn.cursor(db=self._chunks_db)
            if cursor.set_range(key):
                while cursor.key()[:16] == key and cursor.delete():
                    pass
        with self._write_lock:
            self._used, self._num_blocks, self._num_chunks = self._scan_usage()

    def iter_meta(self) -> Iterator[BlockMeta]:
        for _key, meta in self.iter_meta_raw():
            if meta is not None:
                yield meta

    def iter_meta_raw(self) -> Iterator[tuple[bytes, BlockMeta | None]]:
        """Every metadata record as (key, parsed meta or None if malformed)."""
        with self._env.begin(db=self._blocks_db) as txn:
            records = list(txn.cursor())
        for key, value in records:
            try:
                yield bytes(key), BlockMeta.from_bytes(value)
            except ChecksumError:
                yield bytes(key), None

    def iter_chunk_keys(self) -> Iterator[bytes]:
        """Keys of every stored chunk (for fsck and orphan sweeping)."""
        with self._env.begin(db=self._chunks_db) as txn:
            keys = [bytes(k) for k in txn.cursor().iternext(keys=True, values=False)]
        return iter(keys)

    def delete_chunk_keys(self, keys: Sequence[bytes]) -> None:
        """Delete chunks by storage key (orphans). Mutates."""
        with self._write_lock, self._env.begin(write=True) as txn:
            for key in keys:
                txn.delete(key, db=self._chunks_db)

    def usage(self) -> TierUsage:
        return TierUsage(self._used, self._capacity, self._num_blocks, self._num_chunks)

    def data_file(self) -> Path:
        """The LMDB data file (for cold-cache benchmarks)."""
        return self._path / "data.mdb"

    def close(self) -> None:
        self._env.close()

    def _initial_map_size(self) -> int:
        existing = (self._path / "data.mdb").stat().st_size if (self._path / "data.mdb").exists() else 0
        if self._capacity is None:
            return max(self._initial_map, existing)
        return max(_MIN_MAP_BYTES, self._capacity * _MAP_OVERHEAD, existing)

    def _get_meta_raw(self, key: bytes) -> BlockMeta | None:
        with self._env.begin(db=self._blocks_db) as txn:
            value = txn.get(key)
        return None if value is None else BlockMeta.from_bytes(value)

    def _delete_in_txn(self, txn: lmdb.Transaction, meta: BlockMeta) -> None:
        for index in range(meta.num_chunks):
            txn.delete(chunk_key(meta.key, meta.layout_version, index), db=self._chunks_db)
        txn.delete(meta.key, db=self._blocks_db)

    def _scan_usage(self) -> tuple[int, int, int]:
        used = blocks = chunks = 0
        for _key, meta in self.iter_meta_raw():
            if meta is not None:
                used += meta.nbytes
                blocks += 1
                chunks += meta.num_chunks
        return used, blocks, chunks

    def _account(self, used: int, blocks: int, chunks: int) -> None:
        self._used += used
        self._num_blocks += blocks
        self._num_chunks += chunks
