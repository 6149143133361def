"""The published batches kept for replay, and the snapshot answers built from them.

A replay answer is either the buffered batches from the asked sequence on, or, when that
sequence is gone from the buffer or too far back, a snapshot (`AllBlocksCleared`, then every
held block) numbered as the batch whose state it describes, followed by the batches published
since. So every answer is at most `TAIL_MAX` + 1 messages, and a snapshot is built once per
state and shared by every request that can use it (its bytes are sent as they are: ZMQ refers
to one buffer for every request). A fresh one is built only when the last one is more than
`TAIL_MAX` batches old, and never more often than `SPACING` times the time the last build took
after it: building snapshots takes at most 1 / (1 + SPACING) of the publisher's time (the GIL
it holds meanwhile is the storing threads' loss), however many routers ask.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable

#: Batches an answer may send after its start (or after its snapshot).
TAIL_MAX = 256
#: After a snapshot build that took d seconds, the next may start d * SPACING seconds later.
SPACING = 19.0

Batch = tuple[int, bytes]  # (sequence number, msgpack payload)


class History:
    """Batches kept for replay (contiguous sequence numbers, newest `keep`) and one snapshot."""

    def __init__(
        self, keep: int, build: Callable[[], bytes], clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._batches: deque[Batch] = deque(maxlen=keep)
        self._build = build  # the snapshot of the state after the newest batch, encoded
        self._clock = clock
        self._snapshot: Batch | None = None
        self._next_build_s = 0.0  # clock() before which no snapshot is built
        self.builds = 0  # snapshots built for replay answers

    def append(self, seq: int, payload: bytes, *, is_snapshot: bool = False) -> None:
        """Keep a published batch (`is_snapshot`: it describes the whole state, as a snapshot
        answer would: answers use it without building one)."""
        self._batches.append((seq, payload))
        if is_snapshot:
            self._snapshot = (seq, payload)

    @property
    def last(self) -> int:
        """The newest sequence number kept (-1: none yet)."""
        return self._batches[-1][0] if self._batches else -1

    def answer(self, start: int) -> list[Batch] | None:
        """What a replay from `start` is answered with ([]: nothing that new); None when it
        needs a snapshot and building one now would pass the building budget."""
        last = self.last
        if start > last:
            return []
        if start >= self._batches[0][0] and last - start < TAIL_MAX:
            return self._since(start)
        snapshot = self._current_snapshot()
        if snapshot is None:
            return None
        return [snapshot, *self._since(snapshot[0] + 1)]

    def _current_snapshot(self) -> Batch | None:
        last, snapshot = self.last, self._snapshot
        if snapshot is not None and last - snapshot[0] < TAIL_MAX and snapshot[0] + 1 >= self._batches[0][0]:
            return snapshot  # recent enough, and every batch after it is kept
        now = self._clock()
        if now < self._next_build_s:
            return None
        self._snapshot = (last, self._build())
        took = self._clock() - now
        self._next_build_s = now + took * (1 + SPACING)
        self.builds += 1
        return self._snapshot

    def _since(self, start: int) -> list[Batch]:
        """The kept batches from `start` on (sequence numbers are contiguous: an index)."""
        first = self._batches[0][0]
        return list(itertools.islice(self._batches, max(0, start - first), None))
