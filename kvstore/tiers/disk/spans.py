"""Many byte spans of one file read at once, into the caller's buffers, on a pool of threads.

A query-aware load reads, per layer, a run of chunks or two from every block of the prefix: 64
blocks at 16k tokens, each a few tens of KiB, scattered over the data file. Issued one after the
other, each read waits for the one before it, and a cold disk serves one request at a time. Here a
layer's reads are one submission: `os.preadv` straight into the destination (a record's header and
the chunks after it in one call), up to `threads` of them in flight (`os.preadv` lets go of the
GIL), so the disk sees a queue deep enough to stream; what the page cache holds is copied on the
calling thread first, without waiting (`RWF_NOWAIT`). Which reader to keep was measured
(docs/performance.md, "Partial loads"): a pool of `preadv` against one thread; io_uring and KvikIO
are not installed on the CPU machine and were not measured.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

#: Reads in flight at once: enough to keep an NVMe queue busy with reads of tens of KiB.
THREADS = 8
#: Fewer spans than this are read on the calling thread (a pool round costs ~50 us).
INLINE_SPANS = 4


class SpanReads:
    """Parallel `preadv` of one file descriptor's spans. Thread-safe; `close` ends the pool.

    Args:
        fd: an open file descriptor (not closed here).
        threads: reads in flight at once.
    """

    def __init__(self, fd: int, threads: int = THREADS) -> None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self._fd, self._threads = fd, threads
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._nowait = hasattr(os, "RWF_NOWAIT")
        #: Spans the page cache did not hold whole, so far (read, at least in part, from the disk).
        self.uncached = 0

    def read(self, spans: Sequence[tuple[int, Sequence[memoryview]]]) -> list[int]:
        """Fill each span's buffers, in order, from its file offset; returns the bytes read of each
        (fewer than asked only at the file's end). What the page cache holds of each span, from its
        start, is read on the calling thread (`RWF_NOWAIT`: a memcpy, where a pool round costs more
        than the copy on a busy machine); the rest of it goes to the pool (never read twice).

        Raises:
            OSError: a read failed.
        """
        done = [self._cached(span) for span in spans]
        pending = [i for i, span in enumerate(spans) if done[i] < _size(span)]
        self.uncached += len(pending)
        if len(pending) < INLINE_SPANS:
            for i in pending:
                done[i] = self.read_one(spans[i], done[i])
            return done
        # one task per thread, each a share of the spans taken in turn (a pool round per span cost
        # ~15 us of the caller's Python: 2 ms a layer of 100 spans), so every thread has a read in
        # flight until the last few
        groups = min(self._threads, len(pending))
        shares = [[(spans[i], done[i]) for i in pending[g::groups]] for g in range(groups)]
        for group, counts in enumerate(self._executor().map(self._read_group, shares)):
            for i, count in zip(pending[group::groups], counts, strict=True):
                done[i] = count
        return done

    def _cached(self, span: tuple[int, Sequence[memoryview]]) -> int:
        """The bytes of `span` read from what the page cache holds, from its start (never waits for
        the disk); the rest is read from where this stopped (`read_one`), not again."""
        if not self._nowait:
            return 0
        offset, buffers = span
        try:
            return max(os.preadv(self._fd, list(buffers), offset, os.RWF_NOWAIT), 0)
        except BlockingIOError:
            return 0
        except OSError:  # RWF_NOWAIT unsupported here (an old kernel, some file systems)
            self._nowait = False
            return 0

    def close(self) -> None:
        """End the pool (reads under way finish first). Idempotent."""
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._closed:
                raise OSError("the span reader is closed")
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="kvsieve-span-read")
            return self._pool

    def _read_group(self, spans: Sequence[tuple[tuple[int, Sequence[memoryview]], int]]) -> list[int]:
        return [self.read_one(span, skip) for span, skip in spans]

    def read_one(self, span: tuple[int, Sequence[memoryview]], done: int = 0) -> int:
        """Read `span` from its byte `done` on (those before it are read), on this thread, waiting for
        the disk; the bytes read of it (fewer than asked only at the file's end)."""
        offset, buffers = span
        wanted = _size(span)
        while done < wanted:  # a short read mid-file (a signal): the rest, from where it stopped
            more = os.preadv(self._fd, _after(buffers, done) if done else list(buffers), offset + done)
            if more <= 0:
                break
            done += more
        return done


def _size(span: tuple[int, Sequence[memoryview]]) -> int:
    return sum(b.nbytes for b in span[1])


def _after(buffers: Sequence[memoryview], skip: int) -> list[memoryview]:
    """The parts of `buffers` after their first `skip` bytes."""
    rest: list[memoryview] = []
    for buf in buffers:
        if skip >= buf.nbytes:
            skip -= buf.nbytes
            continue
        rest.append(buf.cast("B")[skip:])
        skip = 0
    return rest
