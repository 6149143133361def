"""Write-behind: remote writes leave the store's path and go out on a worker thread.

A Store commits to the local tiers and returns; its blocks for the remote tier
wait here. The queue is bounded in bytes: when a block does not fit, it is
dropped and counted, never waited for, because a slow remote must not slow the
client (the block is still held locally; other sidecars just miss it). On close,
the worker drains what it can within a deadline and counts what it had to drop.

The queue and its thread are the one write-behind mechanism of every tier
(kvstore/tiers/behind.py); this is its remote policy: a block at a time, drop when full,
a failed write counted and gone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

from kvstore.format.block_meta import BlockMeta
from kvstore.tiers.behind import BehindQueue

WriteFn = Callable[[BlockMeta, Sequence[bytes | memoryview]], None]
_Block = tuple[BlockMeta, Sequence[bytes | memoryview]]


class WriteBehindStats(NamedTuple):
    """Totals of a write-behind queue (blocks), and what waits now."""

    queued: int
    written: int
    failed: int
    dropped: int
    pending_blocks: int
    pending_bytes: int


class WriteBehind:
    """A bounded queue of block writes and the one thread that performs them.

    `write` is called on the worker thread with each block, in submission order;
    an exception from it counts the block as failed (the remote tier counts why).
    """

    def __init__(self, write: WriteFn, max_bytes: int, name: str = "kvsieve-write-behind") -> None:
        if max_bytes <= 0:
            raise ValueError(f"write-behind max_bytes must be > 0, got {max_bytes}")

        def write_one(batch: list[_Block]) -> None:  # batches of one: a failure is that block's
            write(*batch[0])

        self._queue = BehindQueue[_Block](write_one, max_bytes, name=name)

    def submit(self, meta: BlockMeta, chunks: Sequence[bytes | memoryview]) -> bool:
        """Queue a block for the remote tier. Never blocks. False (counted) if it was dropped."""
        return self._queue.submit((meta, chunks), sum(len(c) for c in chunks))

    def flush(self, timeout_s: float) -> bool:
        """Wait until every queued block has been attempted. True if the queue emptied in time."""
        return self._queue.flush(timeout_s)

    def close(self, drain_s: float) -> WriteBehindStats:
        """Stop taking blocks, write what is queued for up to `drain_s` seconds, drop the rest.

        Idempotent. Returns the final totals.
        """
        self._queue.close(max(drain_s, 0.0))
        return self.stats()

    @property
    def worker_alive(self) -> bool:
        """Whether the worker thread is running (False after `close`)."""
        return self._queue.worker_alive

    def stats(self) -> WriteBehindStats:
        """Current totals."""
        s = self._queue.stats()
        return WriteBehindStats(s.queued, s.written, s.failed, s.dropped, s.pending_items, s.pending_bytes)
