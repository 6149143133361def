"""Storing a prompt's new blocks without making the request wait: `BackgroundSaver`, `piece_ranges`.

On a device the new KV leaves the GPU on the copier's stream into pooled pinned buffers, in pieces
of at most `PIECE_BYTES` (a 32k-token prefix of an 8B model is 4.3 GB: one buffer of it would not
fit the pool, and a piece is stored while the next one is copied). Each piece is a store of its
own whole blocks (`kv_start`), in prompt order, so a store that stops half way keeps a prefix.
The buffers are made when the engine starts (`DOWNLOAD_BUFFERS`, off its thread): page-locking
the first one in line cost the first request 0.10-0.17 s on an H200 (issue 47, `e2e_store_vs_prefill`
1.79 at 4k). So all the request does is issue the copies: each layer straight from the cache
into the buffer (no stack of the layers on the device); encoding and the disk are the saver's.

`BackgroundSaver` runs those stores on one thread of its own: the request returns once the copies
are queued. Its queue is bounded in bytes; a store that does not fit is dropped and counted
(`dropped`), never silently: KV not stored costs a later request a recompute, never a wrong answer.
`flush` waits for the queue (the CLI before it exits, tests and benchmarks before they read).
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger(__name__)

#: Bytes of KV a piece of a store copies off the device and stores at most (whole blocks).
PIECE_BYTES = 256 << 20
#: Bytes of KV the saver's queue holds at most (its pieces' pinned buffers are the pool's).
QUEUE_BYTES = 2 << 30
#: Download buffers made when an engine starts (one piece stored while the next one is copied).
DOWNLOAD_BUFFERS = 2


def download_bytes(token_bytes: int, max_positions: int | None) -> int:
    """The largest piece a store copies off the device: `PIECE_BYTES`, or a whole prompt of the
    model's longest (`max_positions`, None: unknown) if that is less (the buffers made ahead for
    it need be no larger)."""
    return max(1, min(PIECE_BYTES, token_bytes * (max_positions or PIECE_BYTES)))


def piece_ranges(start: int, end: int, block_tokens: int | None, token_bytes: int) -> list[tuple[int, int]]:
    """[a, b) token ranges covering [start, end), each of whole blocks (`start` is on a block
    boundary) and at most `PIECE_BYTES` of KV; one range when the block size is unknown."""
    if block_tokens is None:
        return [(start, end)]
    per_piece = max(1, PIECE_BYTES // max(token_bytes * block_tokens, 1)) * block_tokens
    return [(a, min(a + per_piece, end)) for a in range(start, end, per_piece)]


@dataclass
class SaverStats:
    """What the saver did: stores queued, done, dropped (queue full), failed, blocks stored."""

    queued: int = 0
    done: int = 0
    dropped: int = 0
    failed: int = 0
    blocks: int = 0
    last_error: str = ""


class BackgroundSaver:
    """One thread that runs stores in the order they were queued; see module docstring. Thread-safe.

    Args:
        max_bytes: KV bytes queued at most; a store that would pass it is dropped (counted).
    """

    def __init__(self, max_bytes: int = QUEUE_BYTES) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be > 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self.stats = SaverStats()
        self._queue: collections.deque[tuple[int, Callable[[], int]]] = collections.deque()
        self._bytes = 0
        self._busy = False
        self._closed = False
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def submit(self, num_bytes: int, store: Callable[[], int]) -> bool:
        """Queue `store` (it returns the blocks it stored); False if dropped: the queue is full or
        the saver closed."""
        with self._cond:
            if self._closed or (self._bytes and self._bytes + num_bytes > self.max_bytes):
                self.stats.dropped += 1
                return False
            self._queue.append((num_bytes, store))
            self._bytes += num_bytes
            self.stats.queued += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvsieve-saver", daemon=True)
                self._thread.start()
            self._cond.notify_all()
            return True

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every queued store is done; False if `timeout_s` passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._busy, timeout_s)

    def close(self, timeout_s: float | None = None) -> bool:
        """Finish the queued stores, then stop. Idempotent. False if they did not finish in time."""
        done = self.flush(timeout_s)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        return done

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return
                num_bytes, store = self._queue.popleft()
                self._busy = True
            try:
                blocks = store()
                with self._cond:
                    self.stats.done += 1
                    self.stats.blocks += blocks
            except Exception as exc:  # a store that fails is a miss later, never a wrong answer
                logger.warning("kvsieve: a background store failed: %s", exc)
                with self._cond:
                    self.stats.failed += 1
                    self.stats.last_error = str(exc)
            finally:
                with self._cond:
                    self._bytes -= num_bytes
                    self._busy = False
                    self._cond.notify_all()
