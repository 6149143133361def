"""Disk tier: one LMDB environment under the data directory.

A block's chunks and its metadata are written in one write transaction, so a process killed at any
instant leaves either the whole block or none of it. LMDB's copy-on-write B-tree with synchronous
commits gives that without a journal of our own; `put_blocks` writes several blocks in one
transaction (a Store call is all or nothing). The data file is checked before it is mapped
(kvstore/tiers/disk/datafile.py), write failures become `StoreFullError` (disk full) or
`StorageUnavailableError`, and every write first checks that `data.mdb` is still the file that was
opened: one deleted or replaced under a running store fails writes instead of writing into an
unlinked file that vanishes at restart. Values are located by their nodes (disk/locate.py) and
read with pread (disk/pread.py); the map's readahead is off: the B-tree is all it faults in.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lmdb

from kvstore.errors import ChecksumError, DamagedStoreError, StorageUnavailableError, TierFullError
from kvstore.format.block_meta import BlockMeta
from kvstore.keys import KEY_BYTES, chunk_key
from kvstore.stats import TierUsage
from kvstore.tiers.base import Span
from kvstore.tiers.disk.datafile import DATA_FILE, check_data_file, reserve_lock_file, write_error
from kvstore.tiers.disk.locate import NodeLocator
from kvstore.tiers.disk.mapguard import MapGuard
from kvstore.tiers.disk.pread import MapReader, WarmRanges
from kvstore.tiers.jobs import JobThread, SegmentsAhead

_MIN_MAP_BYTES = 64 << 20
_UNBOUNDED_MAP_BYTES = 1 << 30
_MAP_OVERHEAD = 2  # LMDB needs room beyond the payload: B-tree pages, freed pages a reader still sees
_MAX_READERS = 512
_READ_SLACK = 256 << 10  # readahead beyond a block's chunks: its overflow pages' headers, B-tree pages
Block = tuple[BlockMeta, Sequence[bytes | memoryview]]


class LmdbTier:
    """Blocks on disk in LMDB; see module docstring."""

    name = "lmdb"

    def __init__(
        self,
        path: str | os.PathLike[str],
        capacity_bytes: int | None = None,
        initial_map_bytes: int = _UNBOUNDED_MAP_BYTES,
        warm_read_bytes: int = 0,
        warm_ahead: SegmentsAhead | None = None,
        disk_reader: str = "threads",
    ) -> None:
        """Open (or create) the environment under `path`.

        Args:
            capacity_bytes: byte budget of chunk data; the map is sized from it.
                None = unbounded: the map starts at `initial_map_bytes` and doubles when full.
            warm_read_bytes: memory made ahead of need that reads of a block's values land in
                (kvstore/tiers/disk/pread.py `WarmRanges`: the memory tier keeps what it promotes
                there; `warm_ahead`'s arena if given, the memory tier's); 0: fresh memory.
            disk_reader: what reads many values at once (StoreConfig.disk_reader; TieredStore checks it).
        """
        self._path = Path(path)
        self._initial_map = initial_map_bytes
        self._path.mkdir(parents=True, exist_ok=True)
        self._capacity = capacity_bytes
        self._growable = capacity_bytes is None
        self._write_lock = threading.Lock()
        self._map_guard = MapGuard()  # read transactions against a resize of the map
        self._env, self._chunks_db, self._blocks_db = self._open_env()
        try:
            self._used, self._num_blocks, self._num_chunks = self._scan_usage()
        except lmdb.Error as exc:  # B-tree damage LMDB detects while reading the records
            self._env.close()
            raise DamagedStoreError(f"cannot read {self.data_file()}: {exc}", self._path.parent) from exc
        st = os.stat(self.data_file())
        self._file_id = (st.st_dev, st.st_ino)
        self._hints = JobThread(f"kvsieve-readahead-{self._path.name}")
        warm = WarmRanges(warm_read_bytes, ahead=warm_ahead) if warm_read_bytes > 0 else None
        self._reader = MapReader(self.data_file(), warm, disk_reader)
        self._nodes = NodeLocator(self._env.stat()["psize"], self._reader.file_span)

    def _open_env(self) -> tuple[lmdb.Environment, lmdb._Database, lmdb._Database]:
        """Check the data file, reserve the lock file, open LMDB; errors become domain errors."""
        existed = self.data_file().exists()
        if existed:
            check_data_file(self.data_file())
        reserve_lock_file(self._path / "lock.mdb", _MAX_READERS)
        env = None
        try:
            env = lmdb.open(
                str(self._path),
                map_size=self._initial_map_size(),
                max_dbs=4,
                max_readers=_MAX_READERS,
                readahead=False,
                sync=True,
                metasync=True,
            )
            return env, env.open_db(b"chunks"), env.open_db(b"blocks")
        except lmdb.Error as exc:
            if env is not None:
                env.close()
            if not existed:  # a half-created file would read as damage at the next start
                self.data_file().unlink(missing_ok=True)
            if isinstance(exc, lmdb.DiskError):
                raise write_error(exc, self._path) from exc
            raise DamagedStoreError(f"cannot open {self.data_file()}: {exc}", self._path.parent) from exc

    @property
    def path(self) -> Path:
        return self._path  # the directory of the LMDB environment

    def put_block(self, meta: BlockMeta, chunks: Sequence[bytes | memoryview]) -> None:
        self.put_blocks([(meta, chunks)])

    def put_blocks(self, blocks: Sequence[Block]) -> None:
        """Store several blocks in one transaction: all of them or none. Mutates.

        Replaces blocks of the same keys (a damaged old record included). Raises
        `TierFullError` when the map is full, `StoreFullError` when the disk is, and
        `StorageUnavailableError` on an I/O error or a data file deleted under us.
        """
        with self._write_lock:
            olds = [self._read_meta_quiet(meta.key) for meta, _ in blocks]
            for attempt in range(8):
                try:
                    with self._write_txn() as txn:
                        for meta, chunks in blocks:
                            self._put_in_txn(txn, meta, chunks)
                    break
                except lmdb.MapFullError as exc:
                    if not self._growable or attempt == 7:
                        raise TierFullError(f"LMDB map at {self._path} is full") from exc
                    with self._map_guard.resizing():  # no read transaction may be open meanwhile
                        self._env.set_mapsize(self._env.info()["map_size"] * 2)
                        self._reader.invalidate()  # the map may have moved
            for old, (_meta, chunks) in zip(olds, blocks, strict=True):
                if old is not None:
                    self._account(-old.nbytes, -1, -old.num_chunks)
                self._account(sum(len(c) for c in chunks), 1, len(chunks))

    def write_layout(self, old: BlockMeta, new: BlockMeta, chunks: Sequence[bytes | memoryview]) -> None:
        """First half of a re-layout: write the new chunks and switch the metadata. Mutates.

        One transaction. The old layout's chunks stay until `drop_layout`; a process killed in
        between leaves them as stale chunks that fsck reports and the next re-layout sweeps, never
        a block whose metadata points at missing chunks."""
        with self._write_lock, self._write_txn() as txn:
            for index, data in enumerate(chunks):
                txn.put(chunk_key(new.key, new.layout_version, index), data, db=self._chunks_db)
            txn.put(new.key, new.to_bytes(), db=self._blocks_db)
        self._account(new.nbytes - old.nbytes, 0, new.num_chunks - old.num_chunks)  # a migration: count

    def drop_layout(self, old: BlockMeta) -> None:
        """Second half of a re-layout: delete the chunks of the layout `old`. Mutates."""
        with self._write_lock, self._write_txn() as txn:
            for index in range(old.num_chunks):
                txn.delete(chunk_key(old.key, old.layout_version, index), db=self._chunks_db)

    def put_meta(self, meta: BlockMeta) -> bool:
        with self._write_lock, self._write_txn() as txn:
            current = txn.get(meta.key, db=self._blocks_db)
            if current is None or BlockMeta.from_bytes(current).layout_version != meta.layout_version:
                return False
            txn.put(meta.key, meta.to_bytes(), db=self._blocks_db)
            return True

    def warm_reads(self, ahead_bytes: int) -> SegmentsAhead | None:
        """Make `ahead_bytes` of warm memory for reads in the background, and keep that much free;
        returns what makes it (to wait for), None without warm reads."""
        if self._reader.warm is not None:
            self._reader.warm.keep_ahead(ahead_bytes)
        return None if self._reader.warm is None else self._reader.warm.ahead

    def get_chunks(self, meta: BlockMeta, indices: Sequence[int]) -> list[memoryview | None]:
        return self.get_many([(meta, indices)])[0]

    def get_many(self, requests: Sequence[tuple[BlockMeta, Sequence[int]]]) -> list[list[memoryview | None]]:
        """Chunks of several blocks through one cursor, each located by its node (disk/locate.py), all
        read with pread inside the transaction, runs in parallel (disk/pread.py)."""
        runs = [[chunk_key(m.key, m.layout_version, i) for i in indices] for m, indices in requests]
        with self._read_txn(self._chunks_db, buffers=True) as txn:
            cursor = txn.cursor()
            self._reader.will_need(self._nodes.runs_ahead(txn, cursor, runs))  # each block's, at once
            found = self._reader.read([self._nodes.place(txn, cursor, key) for run in runs for key in run])
        ends = itertools.accumulate(len(indices) for _, indices in requests)
        return [found[end - len(indices) : end] for (_, indices), end in zip(requests, ends, strict=True)]

    def get_ranges(self, meta: BlockMeta, index: int, ranges: Sequence[Span]) -> list[memoryview] | None:
        """Slices of one value, read with pread inside the read transaction (only those bytes)."""
        with self._read_txn(self._chunks_db, buffers=True) as txn:
            value = txn.get(chunk_key(meta.key, meta.layout_version, index))
            return None if value is None else self._reader.slices(value, ranges)

    @contextmanager
    def value_in_place(self, meta: BlockMeta, index: int) -> Iterator[memoryview | None]:
        """Record `index` of a block in the map, read-only, if the page cache holds it all (disk/resident.py),
        else None; valid in the `with` only, a read transaction (make no other read of this tier in it)."""
        with self._read_txn(self._chunks_db, buffers=True) as txn:
            cursor, key = txn.cursor(), chunk_key(meta.key, meta.layout_version, index)
            place = self._nodes.place(txn, cursor, key)
            yield None if place is None else self._reader.in_place(place, cursor.key())

    def value_spans(self, requests: Sequence[tuple[BlockMeta, int]]) -> list[tuple[int, int] | None]:
        """(data file offset, bytes) of each record (`meta`, index), None where not held, located
        by its node (no byte of it read); read later (`read_spans`) under a pin, and verified."""
        with self._read_txn(self._chunks_db, buffers=True) as txn:
            return self._spans(txn, [chunk_key(m.key, m.layout_version, i) for m, i in requests])

    def _spans(self, txn: Any, keys: Sequence[bytes]) -> list[tuple[int, int] | None]:
        cursor, span = txn.cursor(), self._reader.file_span
        places = [self._nodes.place(txn, cursor, key) for key in keys]
        return [p if p is None or isinstance(p, tuple) else span(p, len(p)) for p in places]

    def read_spans(self, spans: Sequence[tuple[int, Sequence[memoryview]]]) -> list[int]:
        """Fill each span's buffers from its data file offset, in parallel; bytes read of each."""
        try:
            return self._reader.spans.read(spans)
        except OSError as exc:
            raise StorageUnavailableError(f"reading {self.data_file()}: {exc}") from exc

    def will_need(self, spans: Sequence[tuple[int, int]]) -> None:
        """Have the kernel read these (offset, bytes) spans ahead, from the hint thread; returns at once."""
        self._hints.submit(functools.partial(self._reader.will_need, list(spans)))

    def prefetch(self, requests: Sequence[tuple[BlockMeta, Sequence[int]]]) -> None:
        """Have the kernel read these blocks' chunks in the background (a load's disk reads overlap the
        checks and copies of those before them); at once: the hint thread locates and advises them."""
        wanted = [(m.key, m.layout_version, min(units), m.nbytes) for m, units in requests if units]
        self._hints.submit(lambda: self._hint(wanted))

    def _hint(self, wanted: list[tuple[bytes, int, int, int]]) -> None:
        """Locate each block's first chunk and hint its bytes at once, in load order: the disk
        reads block 1 while block 2's B-tree page is still being faulted in."""
        with contextlib.suppress(lmdb.Error, OSError), self._read_txn(self._chunks_db, buffers=True) as txn:
            places = self._spans(txn, [chunk_key(key, version, first) for key, version, first, _ in wanted])
            for (*_, nbytes), place in zip(wanted, places, strict=True):  # a block's chunks lie in order
                if place is not None:
                    self._reader.will_need([(place[0], nbytes + _READ_SLACK)])

    def get_meta(self, key: bytes) -> BlockMeta | None:
        return self._get_meta_raw(key)

    def contains(self, key: bytes) -> bool:
        with self._read_txn(self._blocks_db) as txn:
            return txn.get(key) is not None

    def delete_block(self, key: bytes) -> int:
        with self._write_lock:
            meta = self._read_meta_quiet(key)
            if meta is None and not self.contains(key):
                return 0
            with self._write_txn() as txn:
                self._delete_key_in_txn(txn, key)  # a damaged record goes too, chunks and all
            if meta is None:
                return 0
            self._account(-meta.nbytes, -1, -meta.num_chunks)
            return meta.nbytes

    def delete_raw(self, key: bytes) -> None:
        """Delete a metadata record even if it does not parse (fsck --repair). Mutates."""
        with self._write_lock, self._write_txn() as txn:
            self._delete_key_in_txn(txn, key)
        with self._write_lock:
            self._used, self._num_blocks, self._num_chunks = self._scan_usage()

    def iter_meta(self) -> Iterator[BlockMeta]:
        yield from (meta for _key, meta in self.iter_meta_raw() if isinstance(meta, BlockMeta))

    def iter_meta_raw(self) -> Iterator[tuple[bytes, BlockMeta | str]]:
        """Every metadata record as (key, verified meta, or why it failed verification)."""
        with self._read_txn(self._blocks_db) as txn:
            records = list(txn.cursor())
        for key, value in records:
            try:
                yield bytes(key), _verified(bytes(key), value)
            except ChecksumError as exc:
                yield bytes(key), str(exc)

    def iter_chunk_keys(self) -> Iterator[bytes]:
        """Keys of every stored chunk (for fsck and orphan sweeping)."""
        with self._read_txn(self._chunks_db) as txn:
            keys = [bytes(k) for k in txn.cursor().iternext(keys=True, values=False)]
        return iter(keys)

    def delete_chunk_keys(self, keys: Sequence[bytes]) -> None:
        """Delete chunks by storage key (orphans). Mutates."""
        with self._write_lock, self._write_txn() as txn:
            for key in keys:
                txn.delete(key, db=self._chunks_db)

    def usage(self) -> TierUsage:
        return TierUsage(self._used, self._capacity, self._num_blocks, self._num_chunks)

    def data_file(self) -> Path:
        return self._path / DATA_FILE  # for cold-cache benchmarks

    def close(self) -> None:
        self._hints.close()  # its transactions end before the environment does
        if self._reader.warm is not None:
            self._reader.warm.close()
        self._env.close()
        self._reader.close()

    def _initial_map_size(self) -> int:
        data_file = self._path / DATA_FILE
        existing = data_file.stat().st_size if data_file.exists() else 0
        if self._capacity is None:
            return max(self._initial_map, existing)
        return max(_MIN_MAP_BYTES, self._capacity * _MAP_OVERHEAD, existing)

    def _get_meta_raw(self, key: bytes) -> BlockMeta | None:
        with self._read_txn(self._blocks_db) as txn:
            value = txn.get(key)
            return None if value is None else _verified(key, value)

    def _read_meta_quiet(self, key: bytes) -> BlockMeta | None:
        """The verified metadata of `key`, or None if absent or damaged (about to be replaced)."""
        try:
            return self._get_meta_raw(key)
        except ChecksumError:
            return None

    @contextmanager
    def _read_txn(self, db: lmdb._Database, buffers: bool = False) -> Iterator[Any]:
        """A read transaction that a resize of the map waits for (kvstore/tiers/disk/mapguard.py)."""
        with self._map_guard.reading():
            txn = self._env.begin(db=db, buffers=True) if buffers else self._env.begin(db=db)
            with txn:
                yield txn

    @contextmanager
    def _write_txn(self) -> Iterator[lmdb.Transaction]:
        """A write transaction on the file we opened; I/O failures become domain errors."""
        self._check_file()
        try:
            with self._env.begin(write=True) as txn:
                yield txn
        except lmdb.MapFullError:
            raise
        except lmdb.Error as exc:
            raise write_error(exc, self._path) from exc

    def _check_file(self) -> None:
        try:
            st = os.stat(self.data_file())
        except FileNotFoundError:
            st = None
        if st is None or (st.st_dev, st.st_ino) != self._file_id:
            raise StorageUnavailableError(
                f"{self.data_file()} was deleted or replaced under the running store: writes are "
                "refused (they would go to a file that no longer has a name); restart the store"
            )

    def _put_in_txn(
        self, txn: lmdb.Transaction, meta: BlockMeta, chunks: Sequence[bytes | memoryview]
    ) -> None:
        self._delete_key_in_txn(txn, meta.key)
        for index, data in enumerate(chunks):
            txn.put(chunk_key(meta.key, meta.layout_version, index), data, db=self._chunks_db)
        txn.put(meta.key, meta.to_bytes(), db=self._blocks_db)

    def _delete_key_in_txn(self, txn: lmdb.Transaction, key: bytes) -> None:
        """Delete a block's record and every chunk under its key, whatever their layout."""
        txn.delete(key, db=self._blocks_db)
        cursor = txn.cursor(db=self._chunks_db)
        if cursor.set_range(key):
            while cursor.key()[:KEY_BYTES] == key and cursor.delete():
                pass

    def _scan_usage(self) -> tuple[int, int, int]:
        used = blocks = chunks = 0
        for _key, meta in self.iter_meta_raw():
            if isinstance(meta, BlockMeta):
                used += meta.nbytes
                blocks += 1
                chunks += meta.num_chunks
        return used, blocks, chunks

    def _account(self, used: int, blocks: int, chunks: int) -> None:
        self._used += used
        self._num_blocks += blocks
        self._num_chunks += chunks


def _verified(key: bytes, value: bytes | memoryview) -> BlockMeta:
    """Parse and verify a record stored under `key`; it must name that key."""
    meta = BlockMeta.from_bytes(value)
    if meta.key != key:
        raise ChecksumError(f"record under {key.hex()} names block {meta.key.hex()}")
    return meta
