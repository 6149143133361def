"""Work made off the loading thread: `JobThread` runs jobs in order on one daemon thread, and
`SegmentsAhead` uses one to keep a `HostArena`'s memory made before anyone needs it.

Both exist because of what measurement showed on the loading thread:

- Locating a load's values faults the B-tree pages in cold, one block at a time, and
  posix_fadvise blocks until its reads are queued: hinting a cold 47 MB load on the loading
  thread delayed its first chunk 29-60 ms here, about the time of all the reads, so nothing
  overlapped (the disk tier's read-ahead hints run on a `JobThread` since).
- Memory a load reads into must exist, and making it is the expensive part: fresh pages fault
  in at ~2.5 us each here (30-35 ms of a 47 MB load), and on a GPU host page-locking a 256 MiB
  segment took 0.136 s, three of them 0.41 s of a cold 16k load (issue 47). `SegmentsAhead`
  makes the next segment on a thread of its own at the lowest priority, so the loads and the
  engine beside it go first, whenever less than `ahead_bytes` is free.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable

from kvstore.tiers.arena import HostArena

logger = logging.getLogger(__name__)


class JobThread:
    """One daemon thread that runs jobs in order, off the caller's thread; started on first use.

    Args:
        name: the thread's name (the tests and `py-spy` find it by it).
        low_priority: run at the lowest CPU priority (Linux: per thread), for work that is only
            ever ahead of need.
    """

    def __init__(self, name: str, low_priority: bool = False) -> None:
        self._name, self._low = name, low_priority
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, job: Callable[[], None]) -> None:
        """Run `job` after the jobs before it; ignored once closed. An exception it raises is
        logged (debug) and ends only that job."""
        with self._lock:
            if self._closed:
                return
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._jobs.put(job)

    def close(self) -> None:
        """Stop: the job running finishes, queued ones are dropped. Idempotent."""
        with self._lock:
            self._closed = True
            thread, self._thread = self._thread, None
            if thread is not None:
                self._jobs.put(None)
        if thread is not None:
            thread.join()

    def _run(self) -> None:
        if self._low:
            with contextlib.suppress(OSError, AttributeError):
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        while (job := self._jobs.get()) is not None:
            if self._closed:  # closing: the loads these jobs were for are over
                continue
            try:
                job()
            except Exception:  # ahead of need only: one that fails must not end the ones after it
                logger.debug("background job failed", exc_info=True)


class SegmentsAhead:
    """Keeps at least `ahead_bytes` of `arena` free in segments made ahead, on a low-priority
    thread of its own; from then on the arena makes no segment in `take` (a take that finds no
    room returns None, and its caller keeps its bytes elsewhere). Thread-safe.

    Args:
        arena: the arena to keep ahead of need.
        name: the thread's name.
        ahead_bytes: free bytes to keep made (at least one segment is made at a time).
    """

    def __init__(self, arena: HostArena, name: str, ahead_bytes: int = 0) -> None:
        self.arena = arena
        self.ahead_bytes = ahead_bytes
        self._thread = JobThread(name, low_priority=True)
        self._lock = threading.Lock()
        self._growing = False
        arena.grow_ahead(self.keep_ahead)

    def keep_ahead(self, ahead_bytes: int | None = None) -> None:
        """Have a segment made on the thread while less than `ahead_bytes` (given: from now on)
        is free and room is left under the arena's capacity. Returns at once."""
        if ahead_bytes is not None:
            self.ahead_bytes = ahead_bytes
        usage = self.arena.usage()
        if usage.segment_bytes - usage.used_bytes >= self.ahead_bytes:
            return
        if usage.segment_bytes + self.arena.segment_bytes > self.arena.capacity_bytes:
            return
        with self._lock:
            if self._growing:
                return
            self._growing = True
        self._thread.submit(self._grow)

    def wait(self, timeout_s: float = 30.0) -> bool:
        """Wait until `ahead_bytes` is free, or the capacity is reached (tests, benchmarks, a
        store's start where asked). False if it was not within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            usage = self.arena.usage()
            if usage.segment_bytes - usage.used_bytes >= self.ahead_bytes or (
                usage.segment_bytes + self.arena.segment_bytes > self.arena.capacity_bytes
            ):
                return True
            done = threading.Event()
            self.keep_ahead()
            self._thread.submit(done.set)  # after the segment just asked for
            if not done.wait(max(0.0, deadline - time.monotonic())) or time.monotonic() > deadline:
                return False

    def close(self) -> None:
        """Stop making segments (the one being made is finished); the arena still makes none in a
        take. Idempotent."""
        self._thread.close()
        # no cycle left between the arena and this: a closed store's segments go with its last
        # reference, not at some later collection (a gen-2 collection freeing 256 MiB took 245 ms
        # of the next store's load here)
        self.arena.grow_ahead(_nothing)

    def _grow(self) -> None:
        try:
            made = self.arena.make_segment()
        finally:
            with self._lock:
                self._growing = False
        if made:
            self.keep_ahead()  # the loads meanwhile may have taken it already


def _nothing() -> None:
    """What a closed `SegmentsAhead` leaves the arena to call after a take."""
