"""Chunk eviction policies of the memory cache, used by the store's index.

The index (kvstore/index/store_index.py) owns eviction of every local tier. Beside a durable
tier, memory is a cache of it and gives up single chunks, ranked by one of these
policies; the tiers themselves only store bytes. A policy is not thread-safe: the
index calls it under its memory lock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from typing import Protocol

import numpy as np

from kvstore.format.block_meta import BlockMeta

ChunkRef = tuple[bytes, int]  # (block key, chunk index)


class EvictionPolicy(Protocol):
    """Chooses which chunks leave memory first."""

    def touch(self, ref: ChunkRef, meta: BlockMeta) -> None:
        """Record an insertion or a read of `ref`."""
        ...

    def remove(self, ref: ChunkRef) -> None:
        """Forget `ref` (deleted or evicted)."""
        ...

    def victims(self) -> Iterator[ChunkRef]:
        """Chunks in eviction order, first to go first (a snapshot: removal while iterating is safe)."""
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
