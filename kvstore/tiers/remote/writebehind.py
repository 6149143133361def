"""Write-behind: remote writes leave the store's path and go out on a worker thread.

A Store commits to the local tiers and returns; its blocks for the remote tier
wait here. The queue is bounded in bytes: when a block does not fit, it is
dropped and counted, never waited for, because a slow remote must not slow the
client (the block is still held locally; other sidecars just miss it). On close,
the worker drains what it can within a deadline and counts what it had to drop.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

from kvstore.format.block_meta import BlockMeta

WriteFn = Callable[[BlockMeta, Sequence[bytes]], None]


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
        self._write = write
        self._max_bytes = max_bytes
        self._pending: collections.deque[tuple[BlockMeta, Sequence[bytes], int]] = collections.deque()
        self._pending_bytes = 0
        self._cond = threading.Condition()
        self._in_flight = False
        self._closing = False
        self._queued = self._written = self._failed = self._dropped = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, meta: BlockMeta, chunks: Sequence[bytes]) -> bool:
        """Queue a block for the remote tier. Never blocks. False (counted) if it was dropped."""
        size = sum(len(c) for c in chunks)
        with self._cond:
            if self._closing or self._pending_bytes + size > self._max_bytes:
                self._dropped += 1
                return False
            self._pending.append((meta, chunks, size))
            self._pending_bytes += size
            self._queued += 1
            self._cond.notify()
        return True

    def flush(self, timeout_s: float) -> bool:
        """Wait until every queued block has been attempted. True if the queue emptied in time."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._pending or self._in_flight:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, drain_s: float) -> WriteBehindStats:
        """Stop taking blocks, write what is queued for up to `drain_s` seconds, drop the rest.

        Idempotent. Returns the final totals.
        """
        self.flush(drain_s)
        with self._cond:
            self._closing = True
            self._dropped += len(self._pending)
            self._pending.clear()
            self._pending_bytes = 0
            self._cond.notify_all()
        # A write already on the wire ends within the remote tier's socket timeout.
        self._thread.join(timeout=max(drain_s, 0.0) + 5.0)
        return self.stats()

    @property
    def worker_alive(self) -> bool:
        """Whether the worker thread is running (False after `close`)."""
        return self._thread.is_alive()

    def stats(self) -> WriteBehindStats:
        """Current totals."""
        with self._cond:
            return WriteBehindStats(
                self._queued, self._written, self._failed, self._dropped,
                len(self._pending), self._pending_bytes,
            )  # fmt: skip

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closing:
                    self._cond.wait()
                if not self._pending:
                    return
                meta, chunks, size = self._pending.popleft()
                self._pending_bytes -= size
                self._in_flight = True
            ok = self._attempt(meta, chunks)
            with self._cond:
                self._in_flight = False
                if ok:
                    self._written += 1
                else:
                    self._failed += 1
                self._cond.notify_all()

    def _attempt(self, meta: BlockMeta, chunks: Sequence[bytes]) -> bool:
        try:
            self._write(meta, chunks)
        except Exception:  # any remote failure is counted, never raised to a client
            return False
        return True
