"""Writes behind the request: a bounded queue of items and the one thread that writes them.

One mechanism for every tier written behind a Store: the local disk (group commits of
many blocks in one LMDB transaction, kvstore/store/commit.py) and the shared remote tier
(one block at a time, kvstore/tiers/remote/writebehind.py). They differ only in policy:

- batching: the worker takes up to `batch_items` items at once, waiting up to `batch_s`
  after the first one for more (a group commit pays one sync for all of them);
- when the bound is passed: `submit` drops and counts (a slow remote must not slow the
  client), or a caller asks `admit` first and waits up to a deadline for room (the disk:
  nothing is ever dropped silently; the caller refuses the request itself);
- when a write fails: the batch is counted failed and gone (remote), or put back at the
  head and tried again after `retry_s` (the disk: memory still holds the only copy).

Items are written in submission order, and a batch is never reordered past another, so a
block's parent is always written in the same batch as the block or before it.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from collections.abc import Callable
from typing import Generic, NamedTuple, TypeVar

T = TypeVar("T")


class QueueStats(NamedTuple):
    """Totals of a queue (items), and what waits now (items not yet written, in flight included)."""

    queued: int
    written: int
    failed: int
    dropped: int
    pending_items: int
    pending_bytes: int
    batches: int  # batches written
    retries: int  # failed attempts put back to be tried again
    waits: int  # admissions that had to wait for room


class BehindQueue(Generic[T]):
    """Items written by one worker thread, in batches, in submission order; see module docstring.

    Args:
        write: called on the worker with each batch (a non-empty list, submission order);
            an exception fails the batch.
        max_bytes: the bound on the bytes of items submitted (or admitted) and not yet written.
        batch_items: most items in one batch.
        batch_bytes: most bytes in one batch (an item larger alone); None: no bound. A batch
            well under `max_bytes` lets submitters add to the queue while it is written. Only
            `batch_items` items make a batch ready before `batch_s`.
        batch_s: how long the worker waits after a batch's first item for more.
        retry_s: None: a failed batch is counted and gone; else it is tried again after this
            many seconds (once more at close, then counted failed).
        on_failure: called with a batch given up on (after counting), on the worker.
    """

    def __init__(
        self, write: Callable[[list[T]], None], max_bytes: int, *, batch_items: int = 1,
        batch_s: float = 0.0, retry_s: float | None = None, batch_bytes: int | None = None,
        on_failure: Callable[[list[T]], None] = lambda batch: None, name: str = "kvsieve-behind",
    ) -> None:  # fmt: skip
        if max_bytes <= 0 or batch_items < 1 or batch_s < 0:
            raise ValueError(f"need max_bytes > 0, batch_items >= 1, batch_s >= 0: {max_bytes}, "
                             f"{batch_items}, {batch_s}")  # fmt: skip
        self._write, self._on_failure = write, on_failure
        self._max_bytes, self._batch_items, self._batch_s, self._retry_s = (
            max_bytes,
            batch_items,
            batch_s,
            retry_s,
        )
        self._batch_bytes = batch_bytes
        self._items: collections.deque[tuple[T, int, float]] = collections.deque()
        self._bytes = 0  # admitted + queued + in flight
        self._in_flight = 0
        self._cond = threading.Condition()
        self._closing = False
        self._hurry = 0  # flushes waiting: the worker does not wait for a batch to fill
        self._totals = collections.Counter[str]()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def admit(self, size: int, wait_s: float) -> bool:
        """Reserve room for `size` bytes, waiting up to `wait_s` seconds for it; False (nothing
        reserved) if it did not come or the queue is closing. An empty queue admits any size."""
        deadline = time.monotonic() + wait_s
        with self._cond:
            if not self._fits(size):
                self._totals["waits"] += 1
                self._hurry += 1  # room comes sooner if the worker does not wait to fill a batch
                self._cond.notify_all()
                try:
                    while not self._fits(size) and not self._closing:
                        left = deadline - time.monotonic()
                        if left <= 0:
                            return False
                        self._cond.wait(left)
                finally:
                    self._hurry -= 1
            if self._closing:
                return False
            self._bytes += size
            return True

    def release(self, size: int) -> None:
        """Give back room `admit` reserved that will not be submitted."""
        with self._cond:
            self._bytes -= size
            self._cond.notify_all()

    def submit(self, item: T, size: int, *, admitted: bool = False) -> bool:
        """Queue `item` of `size` bytes. Never blocks. Without `admitted` room, an item that
        does not fit is dropped and counted: False. After `close`, always dropped."""
        with self._cond:
            if self._closing or (not admitted and not self._fits(size)):
                self._totals["dropped"] += 1
                if admitted:
                    self._bytes -= size
                return False
            if not admitted:
                self._bytes += size
            self._items.append((item, size, time.monotonic()))
            self._totals["queued"] += 1
            self._cond.notify_all()
        return True

    def flush(self, timeout_s: float) -> bool:
        """Wait until every queued item has been attempted (failed ones retried until they are
        written or given up on). True if the queue emptied in time."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self._hurry += 1
            self._cond.notify_all()
            try:
                while self._items or self._in_flight:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    self._cond.wait(left)
            finally:
                self._hurry -= 1
        return True

    def close(self, drain_s: float | None) -> QueueStats:
        """Stop taking items and finish. `drain_s` None: write everything queued (failed
        batches get one more try, then are given up on); else write for up to `drain_s`
        seconds and drop the rest. Idempotent. Returns the final totals."""
        if drain_s is not None:
            self.flush(drain_s)
        with self._cond:
            self._closing = True
            if drain_s is not None:
                dropped = list(self._items)
                self._items.clear()
                self._totals["dropped"] += len(dropped)
                self._bytes -= sum(size for _, size, _ in dropped)
            self._cond.notify_all()
        # A write already under way ends within its tier's own timeout.
        self._thread.join(timeout=None if drain_s is None else drain_s + 5.0)
        return self.stats()

    def peek(self, count: int) -> list[T]:
        """The first `count` items queued and not yet taken into a batch (the next batch's)."""
        with self._cond:
            return [item for item, _, _ in itertools.islice(self._items, count)]

    @property
    def worker_alive(self) -> bool:
        """Whether the worker thread is running (False after `close`)."""
        return self._thread.is_alive()

    def stats(self) -> QueueStats:
        """Current totals."""
        with self._cond:
            t = self._totals
            return QueueStats(
                t["queued"], t["written"], t["failed"], t["dropped"], len(self._items) + self._in_flight,
                self._bytes, t["batches"], t["retries"], t["waits"],
            )  # fmt: skip

    def _fits(self, size: int) -> bool:
        return self._bytes == 0 or self._bytes + size <= self._max_bytes

    def _run(self) -> None:
        while True:
            batch = self._next_batch()
            if batch is None:
                return
            error = self._attempt([item for item, _, _ in batch])
            self._finish(batch, error)

    def _next_batch(self) -> list[tuple[T, int, float]] | None:
        """The next batch, once full, `batch_s` old, or hurried (flush, a waiting admission,
        close); None once closing with nothing left."""
        with self._cond:
            while not self._items and not self._closing:
                self._cond.wait()
            if not self._items:
                return None
            ready_at = self._items[0][2] + self._batch_s
            while len(self._items) < self._batch_items and not self._closing and not self._hurry:
                left = ready_at - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            batch = [self._items.popleft() for _ in range(self._take_count())]
            self._in_flight = len(batch)
            return batch

    def _take_count(self) -> int:
        """How many queued items the next batch takes: up to `batch_items` and `batch_bytes`."""
        count = size = 0
        for _, item_size, _ in self._items:
            if count == self._batch_items or (
                count and self._batch_bytes is not None and size + item_size > self._batch_bytes
            ):
                break
            count += 1
            size += item_size
        return count

    def _pause_locked(self, seconds: float) -> None:
        """Wait `seconds` before a retry (close cuts it short: the last try comes at once)."""
        deadline = time.monotonic() + seconds
        while not self._closing and (left := deadline - time.monotonic()) > 0:
            self._cond.wait(left)

    def _attempt(self, items: list[T]) -> BaseException | None:
        try:
            self._write(items)
        except Exception as exc:  # counted, never raised to the thread that submitted
            return exc
        return None

    def _finish(self, batch: list[tuple[T, int, float]], error: BaseException | None) -> None:
        given_up: list[T] = []
        with self._cond:
            self._in_flight = 0
            if error is None:
                self._totals.update(written=len(batch), batches=1)
                self._bytes -= sum(size for _, size, _ in batch)
            elif self._retry_s is not None and not self._closing:
                self._totals["retries"] += 1
                self._items.extendleft(reversed(batch))  # at the head: order is kept
                self._pause_locked(self._retry_s)
            else:
                self._totals["failed"] += len(batch)
                self._bytes -= sum(size for _, size, _ in batch)
                given_up = [item for item, _, _ in batch]
            self._cond.notify_all()
        if given_up:
            self._on_failure(given_up)
