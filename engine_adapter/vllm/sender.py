"""SaveQueue: the connector's saves, sent to the sidecar by a background thread.

A save must not add the sidecar round trip to a step: vLLM's next step (and the
time to first token of every new prompt) would wait for it. So the save hook
copies the KV out of vLLM's cache synchronously (vLLM may reuse those blocks as
soon as the hook returns) and hands the copy to this queue; one thread sends.

The queue is bounded in bytes (the copies it holds, the one being sent
included). A save that does not fit is dropped and counted, never waited for: a
dropped save is a future cache miss, never wrong KV. On shutdown, what is queued
is sent within a deadline; the rest is dropped and counted, and the thread stops.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Generic, NamedTuple, TypeVar

T = TypeVar("T")

logger = logging.getLogger("kvsieve.vllm")
_JOIN_GRACE_S = 1.0  # for a call's own deadline to fire and its thread to return


class SaveQueueStats(NamedTuple):
    """Counters of a `SaveQueue`.

    Attributes:
        queued: items waiting (the one being sent excluded).
        queued_bytes: bytes held, the item being sent included (what `max_bytes` bounds).
        sent: items handed to `send`, whatever came of it (the guard counts failures).
        dropped: items refused (queue full or closed) or left unsent at shutdown.
    """

    queued: int
    queued_bytes: int
    sent: int
    dropped: int


class SaveQueue(Generic[T]):
    """A byte-bounded queue drained by one background thread. One producer (vLLM's model runner).

    Args:
        send: called on the queue's thread for each item, in order; its exceptions are
            logged, never raised (the caller wraps sidecar calls in a `SidecarGuard`).
        max_bytes: bound on the bytes of the items held (queued or being sent).
        log: where the first drop is reported.
    """

    def __init__(self, send: Callable[[T], object], max_bytes: int, log: logging.Logger = logger) -> None:
        self._send = send
        self.max_bytes = max_bytes
        self.log = log
        self._items: deque[tuple[T, int]] = deque()
        self._held_bytes = 0  # queued + in flight
        self._in_flight = False
        self._closed = False
        self._sent = 0
        self._dropped = 0
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def offer(self, nbytes: int, make: Callable[[], T]) -> bool:
        """Queue `make()` if `nbytes` more fit, else drop it (counted; the first drop is logged).

        `make` runs here, on the caller's thread, only when the item fits: it is
        where the caller copies what must be copied before returning. Never blocks
        on the sender.

        Returns:
            True if queued, False if dropped (queue full or closed).
        """
        with self._cond:
            fits = not self._closed and self._held_bytes + nbytes <= self.max_bytes
            if fits:
                self._held_bytes += nbytes  # reserved: only the sender frees bytes meanwhile
            else:
                self._drop(1)
        if not fits:
            return False
        try:
            item = make()
        except BaseException:
            with self._cond:
                self._held_bytes -= nbytes
            raise
        with self._cond:
            self._items.append((item, nbytes))
            self._start()
            self._cond.notify_all()
        return True

    def flush(self, timeout_s: float) -> bool:
        """Wait until every queued item is sent; False if the deadline passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._items and not self._in_flight, timeout_s)

    def close(self, timeout_s: float) -> bool:
        """Send what is queued within `timeout_s`, drop the rest, stop the thread.

        No send starts after the deadline; the thread is then joined for up to another
        `timeout_s` and a second (an item being sent ends by its own call deadline,
        which the connector sets to `timeout_s` too). Later offers are dropped.

        Returns:
            True if the thread stopped (or never started).
        """
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self._closed = True
            self._cond.wait_for(lambda: not self._items and not self._in_flight, timeout_s)
            left = len(self._items)
            if left:
                self._drop(left)
                self._held_bytes -= sum(n for _, n in self._items)
                self._items.clear()
            self._cond.notify_all()
        if left:
            self.log.warning("kvsieve save queue: %d save(s) not sent before shutdown (dropped)", left)
        thread = self._thread
        if thread is None:
            return True
        thread.join(max(0.0, deadline - time.monotonic()) + timeout_s + _JOIN_GRACE_S)
        return not thread.is_alive()

    def stats(self) -> SaveQueueStats:
        """The current counters."""
        with self._cond:
            return SaveQueueStats(len(self._items), self._held_bytes, self._sent, self._dropped)

    @property
    def running(self) -> bool:
        """Whether the sender thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    def _drop(self, count: int) -> None:
        """Count dropped saves (lock held); log the first one."""
        if self._dropped == 0:
            self.log.warning(
                "kvsieve save queue full (%d of %d bytes held) or closed: a save was dropped "
                "(a future cache miss); further drops are only counted",
                self._held_bytes,
                self.max_bytes,
            )
        self._dropped += count

    def _start(self) -> None:
        """Start the sender thread on first use (lock held): the scheduler role never needs one."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvsieve-save", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._items or self._closed)
                if not self._items:
                    return  # closed and drained (or the rest dropped)
                item, nbytes = self._items.popleft()
                self._in_flight = True
            try:
                self._send(item)
            except Exception:
                self.log.exception("kvsieve save failed")
            finally:
                del item  # the copy is freed before its bytes are
                with self._cond:
                    self._in_flight = False
                    self._held_bytes -= nbytes
                    self._sent += 1
                    self._cond.notify_all()
