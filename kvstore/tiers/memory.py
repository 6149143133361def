"""Memory tier: encoded chunks in host memory under a byte budget.

Beside a durable tier it is a cache: it evicts chunks by itself (its policy chooses
which) to make room, never chunks of pinned blocks, since the disk tier holds a
full copy. As the only tier (`self_evict=False`) it never drops anything by
itself: the store's index chooses whole blocks to evict (`evict_block`), so no
block the index lists can lose a chunk behind its back. Buffers are page-locked
when CUDA is available.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import numpy as np

from kvstore.errors import TierFullError
from kvstore.meta import BlockMeta
from kvstore.tiers.base import TierUsage
from kvstore.tiers.pinned import host_buffer

ChunkRef = tuple[bytes, int]  # (block key, chunk index)


class EvictionPolicy(Protocol):
    """Chooses which chunks leave memory first. Called under the tier's lock."""

    def touch(self, ref: ChunkRef, meta: BlockMeta) -> None:
        """Record an insertion or a read of `ref`."""
        ...

    def remove(self, ref: ChunkRef) -> None:
        """Forget `ref` (deleted or evicted)."""
        ...

    def victims(self) -> Iterator[ChunkRef]:
        """Chunks in eviction order, first to go first."""
        ...


class LruPolicy:
    """Least recently used first. O(1) touch and remove (OrderedDict)."""

    def __init__(self) -> None:
        self._order: OrderedDict[ChunkRef, None] = OrderedDict()

    def touch(self, ref: ChunkRef, meta: BlockMeta) -> None:
        self._order[ref] = None
        self._order.move_to_end(ref)

    def remove(self, ref: ChunkRef) -> None:
        self._order.pop(ref, None)

    def victims(self) -> Iterator[ChunkRef]:
        return iter(list(self._order))


class ScorePolicy:
    """Score-based placement: keep chunks with the highest access frequency x importance mass.

    A chunk's mass is the share of its block's score held by its tokens (uniform
    when the block has no scores). Importance-ordered blocks therefore keep their
    leading chunks (the ones partial loads read) while their tails leave memory
    first; the disk tier keeps everything. Ties go least recently used first.
    Victim order is computed by sorting when room is needed: O(n log n) per put
    that evicts, cheap next to copying a chunk.
    """

    def __init__(self) -> None:
        self._hits: dict[ChunkRef, int] = {}
        self._mass: dict[ChunkRef, float] = {}
        self._last: dict[ChunkRef, int] = {}
        self._clock = 0

    def touch(self, ref: ChunkRef, meta: BlockMeta) -> None:
        self._clock += 1
        self._hits[ref] = self._hits.get(ref, 0) + 1
        self._last[ref] = self._clock
        if ref not in self._mass:
            self._mass[ref] = chunk_mass(meta, ref[1])

    def remove(self, ref: ChunkRef) -> None:
        self._hits.pop(ref, None)
        self._mass.pop(ref, None)
        self._last.pop(ref, None)

    def victims(self) -> Iterator[ChunkRef]:
        return iter(sorted(self._hits, key=lambda r: (self._hits[r] * self._mass[r], self._last[r])))


def chunk_mass(meta: BlockMeta, index: int) -> float:
    """Share of the block's importance held by chunk `index` (1 / chunks when unscored)."""
    if meta.scores is None:
        return 1.0 / meta.num_chunks
    scores = np.clip(np.asarray(meta.scores, dtype=np.float64), 0.0, None)
    total = float(scores.sum())
    if total <= 0:
        return 1.0 / meta.num_chunks
    return float(scores[meta.chunk_offsets(index)].sum()) / total


def create_policy(name: str) -> EvictionPolicy:
    """ "lru" or "score"."""
    if name == "lru":
        return LruPolicy()
    if name == "score":
        return ScorePolicy()
    raise ValueError(f"memory policy must be 'lru' or 'score', got {name!r}")


class MemoryTier:
    """Chunks in RAM; see module docstring."""

    name = "memory"

    def __init__(
        self,
        capacity_bytes: int,
        policy: EvictionPolicy | None = None,
        is_pinned: Callable[[bytes], bool] | None = None,
        pin_host_memory: bool = True,
        self_evict: bool = True,
    ) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self._capacity = capacity_bytes
        self._policy: EvictionPolicy = policy or LruPolicy()
        self._is_pinned = is_pinned or (lambda key: False)
        self._pin_host = pin_host_memory
        self._self_evict = self_evict
        self._chunks: dict[ChunkRef, np.ndarray[Any, Any]] = {}
        self._metas: dict[bytes, BlockMeta] = {}
        self._chunk_count: dict[bytes, int] = {}
        self._used = 0
        self._evictions = 0
        self._lock = threading.Lock()

    @property
    def evictions(self) -> int:
        """Chunks evicted by the policy since start."""
        return self._evictions

    def put_block(self, meta: BlockMeta, chunks: Sequence[bytes]) -> None:
        size = sum(len(c) for c in chunks)
        if size > self._capacity:
            raise TierFullError(f"block of {size} B exceeds the memory tier's {self._capacity} B")
        with self._lock:
            self._delete_locked(meta.key)
            self._make_room_locked(size)
            if self._used + size > self._capacity:
                raise TierFullError("memory tier is full of pinned blocks")
            for index, data in enumerate(chunks):
                self._insert_locked(meta, index, data)
            self._metas[meta.key] = meta

    def put_chunk(self, meta: BlockMeta, index: int, data: bytes | memoryview) -> bool:
        """Promote one chunk read from a slower tier. Mutates. False if it does not fit."""
        with self._lock:
            if (meta.key, index) in self._chunks:
                return True
            self._make_room_locked(len(data))
            if self._used + len(data) > self._capacity:
                return False
            self._insert_locked(meta, index, data)
            self._metas.setdefault(meta.key, meta)
            return True

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
                if buf is not None:
                    self._policy.touch((meta.key, index), meta)
                out.append(None if buf is None else buf.data)
        return out

    def get_meta(self, key: bytes) -> BlockMeta | None:
        with self._lock:
            return self._metas.get(key)

    def contains(self, key: bytes) -> bool:
        with self._lock:
            return key in self._metas

    def delete_block(self, key: bytes) -> int:
        with self._lock:
            return self._delete_locked(key)

    def evict_block(self, key: bytes) -> int:
        """`delete_block` chosen by the store's eviction (counted in `evictions`). Mutates."""
        with self._lock:
            self._evictions += self._chunk_count.get(key, 0)
            return self._delete_locked(key)

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

    def _insert_locked(self, meta: BlockMeta, index: int, data: bytes | memoryview) -> None:
        ref = (meta.key, index)
        self._chunks[ref] = host_buffer(data, self._pin_host)
        self._used += len(data)
        self._chunk_count[meta.key] = self._chunk_count.get(meta.key, 0) + 1
        self._policy.touch(ref, meta)

    def _remove_chunk_locked(self, ref: ChunkRef) -> int:
        buf = self._chunks.pop(ref, None)
        if buf is None:
            return 0
        self._policy.remove(ref)
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

    def _make_room_locked(self, size: int) -> None:
        if not self._self_evict or self._used + size <= self._capacity:
            return
        for ref in self._policy.victims():
            if self._is_pinned(ref[0]):
                continue
            self._evictions += 1
            self._remove_chunk_locked(ref)
            if self._used + size <= self._capacity:
                return
