"""The inbox between the store's threads and the KV-event publisher's thread.

A store thread's whole part in KV events is `Inbox.offer`: one append of a reference to the
index's news (the blocks' metadata, no copy) onto a deque, under the GIL alone. No lock, no
condition to notify: `queue.Queue.put` took a lock and woke the publisher once per stored block,
and every wake made the publisher's thread compete with the storing threads for the GIL. Here
the publisher wakes only when it sleeps idle (the first news after a quiet spell sets an event);
in a burst it drains the inbox on its own schedule (kvstore/events/publisher.py).

Past `capacity` waiting items the news is dropped and counted, and the publisher is told to
read the store afresh (a snapshot): a full inbox never makes a store wait.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from typing import Any

News = tuple[str, Sequence[Any]]


class Inbox:
    """Bounded news from many store threads to one publisher thread (offer / take / wait)."""

    def __init__(self, capacity: int) -> None:
        self._items: deque[News] = deque()
        self._capacity = capacity
        self._wake = threading.Event()
        self._idle = False  # the publisher sleeps in `wait`: the next offer wakes it
        self.dropped = 0  # block changes dropped (a lost increment between threads undercounts)
        self.overflowed = False  # news was dropped since the last `clear`: a snapshot must follow

    # -- store threads: never block --------------------------------------------------

    def offer(self, news: str, items: Sequence[Any]) -> None:
        """Queue a reference to `items`, or drop it (counted) when the inbox is full."""
        if len(self._items) >= self._capacity:
            self.dropped += len(items)
            self.overflowed = True
            self._wake.set()
            return
        self._items.append((news, items))
        # Read after the append: a publisher that set `_idle` before it is woken here, and one
        # that sets it after sees the item when it looks again before sleeping (`wait`).
        if self._idle:
            self._idle = False
            self._wake.set()

    # -- the publisher's thread ------------------------------------------------------

    def __len__(self) -> int:
        return len(self._items)

    def take(self, limit: int) -> list[News]:
        """Up to `limit` items, oldest first."""
        popleft = self._items.popleft  # only this thread takes: what len() counted is there
        return [popleft() for _ in range(min(len(self._items), limit))]

    def clear(self) -> None:
        """Forget every waiting item (a snapshot replaces them); news dropped from now on
        calls for another."""
        self.overflowed = False
        self._items.clear()

    def wait(self, timeout_s: float) -> None:
        """Sleep until news arrives (or `timeout_s`), unless some is waiting already."""
        self._wake.clear()
        self._idle = True
        if not self._items and not self.overflowed:
            self._wake.wait(timeout_s)
        self._idle = False
