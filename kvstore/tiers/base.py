"""The tier interface: where encoded chunks and block metadata live.

A tier moves bytes; it does not decide what to keep. The store decides what to
evict (from the radix tree's recency and pins) and calls `delete_block`.
Every method is thread-safe.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol, runtime_checkable

from kvstore.format.block_meta import BlockMeta
from kvstore.stats import TierUsage

Span = tuple[int, int]  # a byte range [start, end) of one record


class Tier(Protocol):
    """One storage level: memory, LMDB disk or a remote Redis/Valkey."""

    name: str

    def put_block(self, meta: BlockMeta, chunks: Sequence[bytes | memoryview]) -> None:
        """Store a block's encoded chunks and metadata, all or nothing. Mutates.

        Replaces a block of the same key. Raises `TierFullError` when it does not fit.
        """
        ...

    def put_blocks(self, blocks: Sequence[tuple[BlockMeta, Sequence[bytes | memoryview]]]) -> None:
        """Store several blocks, all or nothing, as `put_block` does for one. Mutates.

        LMDB writes them in one transaction; memory checks the room for all of them
        first; Redis writes block by block and deletes the ones it wrote if one fails.
        Raises `TierFullError` when they do not fit (then none of them is kept).
        """
        ...

    def put_meta(self, meta: BlockMeta) -> bool:
        """Replace the metadata of a held block (new scores); chunks untouched. Mutates.

        Returns False, writing nothing, if the block is not held.
        """
        ...

    def get_chunks(self, meta: BlockMeta, indices: Sequence[int]) -> list[memoryview | None]:
        """Encoded chunks `indices` of the block in `meta`'s layout; None where missing.

        The buffers stay valid after the call (they are copies or immutable).
        """
        ...

    def get_ranges(self, meta: BlockMeta, index: int, ranges: Sequence[Span]) -> list[memoryview] | None:
        """Byte ranges [start, end) of one encoded record (a layer record's header, its chunks);
        None if the record is not held. Ranges past the record's end come back short.

        Only the ranges are read (LMDB: those pages of its map; Redis: GETRANGE). The buffers
        stay valid after the call.
        """
        ...

    def get_meta(self, key: bytes) -> BlockMeta | None:
        """The metadata of a block, or None."""
        ...

    def contains(self, key: bytes) -> bool:
        """Whether the block's metadata is held (its chunks may be partly evicted in memory)."""
        ...

    def delete_block(self, key: bytes) -> int:
        """Delete a block's chunks and metadata. Mutates. Returns the bytes freed (0 if absent)."""
        ...

    def iter_meta(self) -> Iterator[BlockMeta]:
        """Every block's metadata (a snapshot; order unspecified)."""
        ...

    def usage(self) -> TierUsage:
        """Current occupancy."""
        ...

    def close(self) -> None:
        """Release files and connections. Idempotent."""
        ...


@runtime_checkable
class BatchTier(Protocol):
    """A tier that reads records of several blocks in one call (LMDB: in parallel; Redis: one
    pipeline), as `Tier.get_chunks` does for one block."""

    name: str

    def get_many(self, requests: Sequence[tuple[BlockMeta, Sequence[int]]]) -> list[list[memoryview | None]]:
        """Per (block, indices), its records as `get_chunks` returns them."""
        ...
