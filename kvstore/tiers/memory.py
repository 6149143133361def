"""Memory tier: encoded chunks in host memory under a byte budget.

Plain storage with a byte count: it never evicts by itself. A put that does not
fit fails (`TierFullError`, or False for one chunk); the store's index
(kvstore/index/store_index.py) decides what leaves memory and calls `delete_chunk` or
`delete_block`, so no block the index lists can lose a chunk behind its back.
A block may be held partly (chunks promoted one by one, or evicted one by one).
Where CUDA is available records are copied into a page-locked `HostArena` (kvstore/tiers/arena.py),
so that loads copy them to the GPU by DMA from where they lie; page-locking is done a segment at a
time, not per record, and a store has the segments made ahead on a thread (`memory_arena`). What a
cold load read into the arena is kept as it lies: no copy on promotion.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from kvstore.config import StoreConfig
from kvstore.errors import TierFullError
from kvstore.format.block_meta import BlockMeta
from kvstore.stats import TierUsage
from kvstore.tiers.arena import HostArena
from kvstore.tiers.base import Span
from kvstore.tiers.jobs import SegmentsAhead
from kvstore.tiers.pinned import cuda_available, host_buffer

ChunkRef = tuple[bytes, int]  # (block key, chunk index)

#: One segment of the memory tier's arena (page-locking is paid per segment: fewer, larger ones).
ARENA_SEGMENT_BYTES = 256 << 20
#: Page-locked memory kept made ahead at least, where CUDA is. Page-locking ran at ~1.9 GB/s on an
#: H200's host (0.136 s per 256 MiB), about what its disk reads cold (1.4-2.0 GB/s): a 1 GiB lead
#: lets a cold load at the disk's speed land in page-locked memory while the thread keeps pace,
#: without page-locking the whole tier at every start (a benchmark reopens its store each run).
PINNED_AHEAD_BYTES = 1 << 30


class MemoryTier:
    """Chunks in RAM; see module docstring. Thread-safe.

    Args:
        capacity_bytes: the byte budget.
        pin_host_memory: page-lock records where CUDA is.
        arena: where records are copied (default: a page-locked arena where CUDA is and
            `auto_arena`; else records are kept as given).
        auto_arena: make that page-locked arena where CUDA is (False: pin record by record).
    """

    name = "memory"

    def __init__(
        self,
        capacity_bytes: int,
        pin_host_memory: bool = True,
        arena: HostArena | None = None,
        auto_arena: bool = True,
    ) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self._capacity = capacity_bytes
        self._pin_host = pin_host_memory
        if arena is None and auto_arena and pin_host_memory and capacity_bytes and cuda_available():
            arena = HostArena(arena_bytes(capacity_bytes), pin=True)
        #: Where records are copied (None: kept as given, or pinned one by one where no arena fits).
        self.arena = arena
        self._chunks: dict[ChunkRef, np.ndarray[Any, Any]] = {}
        self._metas: dict[bytes, BlockMeta] = {}
        self._chunk_count: dict[bytes, int] = {}
        self._used = 0
        self._lock = threading.Lock()

    @property
    def capacity_bytes(self) -> int:
        """The byte budget."""
        return self._capacity

    def put_block(self, meta: BlockMeta, chunks: Sequence[bytes | memoryview | None]) -> None:
        """Hold a block's records (None: one that comes later through `put_chunk`)."""
        with self._lock:
            self._put_locked([(meta, chunks)])

    def put_blocks(self, blocks: Sequence[tuple[BlockMeta, Sequence[bytes | memoryview]]]) -> None:
        with self._lock:
            self._put_locked(blocks)

    def put_chunk(self, meta: BlockMeta, index: int, data: bytes | memoryview) -> bool:
        """Add one chunk (promoted from a slower tier). Mutates. False if it does not fit."""
        with self._lock:
            if (meta.key, index) in self._chunks:
                return True
            if self._used + len(data) > self._capacity:
                return False
            self._insert_locked(meta, index, data)
            self._metas.setdefault(meta.key, meta)
            return True

    def has_chunk(self, key: bytes, index: int) -> bool:
        """Whether chunk `index` of block `key` is held."""
        with self._lock:
            return (key, index) in self._chunks

    def holds(self, key: bytes, indices: Iterable[int]) -> bool:
        """Whether every chunk `indices` of block `key` is held (one lock for all of them)."""
        with self._lock:
            return all((key, index) in self._chunks for index in indices)

    def chunks_held(self, key: bytes) -> int:
        """How many chunks of block `key` are held (0 if none)."""
        with self._lock:
            return self._chunk_count.get(key, 0)

    def put_meta(self, meta: BlockMeta) -> bool:
        with self._lock:
            current = self._metas.get(meta.key)
            if current is None or current.layout_version != meta.layout_version:
                return False
            self._metas[meta.key] = meta
            return True

    def get_chunks(self, meta: BlockMeta, indices: Sequence[int]) -> list[memoryview | None]:
        out: list[memoryview | None] = []
        with self._lock:
            current = self._metas.get(meta.key)
            same_layout = current is not None and current.layout_version == meta.layout_version
            for index in indices:
                buf = self._chunks.get((meta.key, index)) if same_layout else None
                out.append(None if buf is None else buf.data)
        return out

    def get_ranges(self, meta: BlockMeta, index: int, ranges: Sequence[Span]) -> list[memoryview] | None:
        with self._lock:
            current = self._metas.get(meta.key)
            same_layout = current is not None and current.layout_version == meta.layout_version
            buf = self._chunks.get((meta.key, index)) if same_layout else None
        if buf is None:
            return None
        view = buf.data  # read-only and never reused: slices stay valid after an eviction
        return [view[start:end] for start, end in ranges]

    def get_meta(self, key: bytes) -> BlockMeta | None:
        with self._lock:
            return self._metas.get(key)

    def contains(self, key: bytes) -> bool:
        with self._lock:
            return key in self._metas

    def count_present(self, keys: Iterable[bytes]) -> int:
        """How many of `keys` this tier holds (one lock for all: lookups ask for every block)."""
        with self._lock:
            return sum(1 for key in keys if key in self._metas)

    def delete_block(self, key: bytes) -> int:
        with self._lock:
            return self._delete_locked(key)

    def delete_chunk(self, key: bytes, index: int) -> int:
        """Delete one chunk (the block goes when its last chunk does). Mutates. Returns bytes freed."""
        with self._lock:
            return self._remove_chunk_locked((key, index))

    def iter_meta(self) -> Iterator[BlockMeta]:
        with self._lock:
            return iter(list(self._metas.values()))

    def usage(self) -> TierUsage:
        with self._lock:
            return TierUsage(self._used, self._capacity, len(self._metas), len(self._chunks))

    def close(self) -> None:
        with self._lock:
            self._chunks.clear()
            self._metas.clear()
            self._chunk_count.clear()
            self._used = 0

    def _put_locked(self, blocks: Sequence[tuple[BlockMeta, Sequence[bytes | memoryview | None]]]) -> None:
        """All blocks or none: the room is checked for all of them (replaced blocks freed) first."""
        size = sum(len(c) for _, chunks in blocks for c in chunks if c is not None)
        replaced = {meta.key for meta, _ in blocks}
        held = sum(self._block_bytes_locked(key) for key in replaced)
        if self._used - held + size > self._capacity:
            raise TierFullError(
                f"{size} B of blocks do not fit the memory tier "
                f"({self._used - held} of {self._capacity} B used)"
            )
        for meta, chunks in blocks:
            self._delete_locked(meta.key)
            for index, data in enumerate(chunks):
                if data is not None:
                    self._insert_locked(meta, index, data)
            self._metas[meta.key] = meta

    def _block_bytes_locked(self, key: bytes) -> int:
        meta = self._metas.get(key)
        if meta is None:
            return 0
        return sum(
            int(b.size) for i in range(meta.num_chunks) if (b := self._chunks.get((key, i))) is not None
        )

    def _insert_locked(self, meta: BlockMeta, index: int, data: bytes | memoryview) -> None:
        # bytes read into the arena are kept as they lie; no room there: unpinned, never pinned alone
        held = None if self.arena is None else self.arena.keep(data)
        if held is None:
            held = host_buffer(data, self._pin_host and self.arena is None)
        self._chunks[(meta.key, index)] = held
        self._used += len(data)
        self._chunk_count[meta.key] = self._chunk_count.get(meta.key, 0) + 1

    def _remove_chunk_locked(self, ref: ChunkRef) -> int:
        buf = self._chunks.pop(ref, None)
        if buf is None:
            return 0
        self._used -= buf.size
        left = self._chunk_count[ref[0]] - 1
        if left:
            self._chunk_count[ref[0]] = left
        else:
            del self._chunk_count[ref[0]]
            self._metas.pop(ref[0], None)
        return int(buf.size)

    def _delete_locked(self, key: bytes) -> int:
        meta = self._metas.pop(key, None)
        if meta is None:
            return 0
        freed = sum(self._remove_chunk_locked((key, i)) for i in range(meta.num_chunks))
        self._chunk_count.pop(key, None)
        return freed


def arena_bytes(capacity_bytes: int) -> int:
    """The arena for a tier of `capacity_bytes`: a little more, since an evicted record's range is
    reused only once no load holds a view of it any more."""
    return capacity_bytes + max(256 << 20, capacity_bytes // 8)


def memory_arena(config: StoreConfig) -> SegmentsAhead | None:
    """The memory tier's arena, its first segment made now (the store's start: what a Store or a
    load right after it lands in), the rest ahead of need on a low-priority thread (kvstore/tiers/
    jobs.py): `warm_read_ahead_bytes` made and kept free; page-locked where CUDA is (unless
    `pin_host_memory` or `host_arena` is False), and there at least `PINNED_AHEAD_BYTES`. Plain
    where `host_arena` asks for one on the CPU. None where the tier has no arena, or
    `warm_read_ahead_bytes` is 0 (the tier then grows its arena on the caller's thread, as before)."""
    if not config.warm_read_ahead_bytes or not config.memory_bytes or config.host_arena is False:
        return None
    pin = config.pin_host_memory and cuda_available()
    if not pin and not config.host_arena:
        return None
    arena = HostArena(arena_bytes(config.memory_bytes), pin=pin, segment_bytes=ARENA_SEGMENT_BYTES)
    arena.make_segment()
    ahead_bytes = max(config.warm_read_ahead_bytes, PINNED_AHEAD_BYTES if pin else 0)
    ahead = SegmentsAhead(arena, "kvsieve-arena-ahead", min(ahead_bytes, arena.capacity_bytes))
    ahead.keep_ahead()
    return ahead
