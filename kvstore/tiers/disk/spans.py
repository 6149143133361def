"""Many byte spans of one file read at once, into the caller's buffers: through io_uring, or on threads.

A query-aware load reads, per layer, a run of chunks or two from every block of the prefix: 64
blocks at 16k tokens, each a few tens of KiB, scattered over the data file. Issued one after the
other, each read waits for the one before it, and a cold disk serves one request at a time. Here a
layer's reads are one submission, each straight into the destination (a record's header and the
chunks after it in one vectored read), so the disk sees a queue deep enough to stream: `os.preadv`
on a pool of `threads` (it lets go of the GIL), or an io_uring ring with up to 128 in flight
(kvstore/tiers/disk/uring.py, `StoreConfig.disk_reader`). What the page cache holds is copied on the
calling thread first, without waiting (`RWF_NOWAIT`). The readers were measured against each other
(docs/performance.md, issue 46's second round): on the same cold random 32 KiB spans the ring read 1.7x faster
than 8 threads here, but a real layer-by-layer load at 16k tokens ran 10-15 % slower through it
(13 % faster at 4k), so the pool stays the default; KvikIO needs libcuda even for host memory.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from kvstore.config import DISK_READERS
from kvstore.errors import InvalidInputError
from kvstore.tiers.disk import uring

#: Reads in flight at once: enough to keep an NVMe queue busy with reads of tens of KiB.
THREADS = 8
#: Fewer spans than this are read on the calling thread (a pool round costs ~50 us).
INLINE_SPANS = 4


#: The readers a `SpanReads` can use (StoreConfig.disk_reader).
READERS = DISK_READERS


def check_reader(reader: str, ring_refused: bool = False) -> None:
    """Refuse a reader other than `READERS`, and "io_uring" where no ring can be had.

    Raises:
        InvalidInputError: naming what was wrong.
    """
    if reader not in READERS:
        raise InvalidInputError(f"disk reader must be one of {', '.join(READERS)}, got {reader!r}")
    if reader == "io_uring" and (ring_refused or not uring.ring_available()):
        raise InvalidInputError(
            "disk reader io_uring: no ring can be had here (the liburing package is missing: pip install "
            "'kvsieve[uring]', x86-64 Linux only; or the kernel refuses io_uring); use threads"
        )


class SpanReads:
    """Parallel reads of one file descriptor's spans: `preadv` on a pool of threads, or through an
    io_uring ring (kvstore/tiers/disk/uring.py). Thread-safe; `close` ends it.

    Args:
        fd: an open file descriptor (not closed here).
        threads: reads in flight at once on the pool.
        reader: "threads" or "io_uring" (refused where no ring can be had).

    Raises:
        InvalidInputError: as `check_reader`.
    """

    def __init__(self, fd: int, threads: int = THREADS, reader: str = "threads") -> None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        check_reader(reader)
        self._fd, self._threads = fd, threads
        self._ring = uring.open_ring(fd) if reader == "io_uring" else None
        if reader == "io_uring" and self._ring is None:
            check_reader(reader, ring_refused=True)
        #: The reader in use: "io_uring" or "threads".
        self.kind = "threads" if self._ring is None else "io_uring"
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
        than the copy on a busy machine); the rest of it goes to the ring or the pool (never read
        twice).

        Raises:
            OSError: a read failed.
        """
        if self._closed:
            raise OSError("the span reader is closed")
        done = [self._cached(span) for span in spans]
        pending = [i for i, span in enumerate(spans) if done[i] < _size(span)]
        self.uncached += len(pending)
        if len(pending) < 2 or (self._ring is None and len(pending) < INLINE_SPANS):
            for i in pending:
                done[i] = self.read_one(spans[i], done[i])
            return done
        if self._ring is not None:
            rest = [(spans[i][0] + done[i], _after(spans[i][1], done[i])) for i in pending]
            for i, got in zip(pending, self._ring.read(rest), strict=True):
                done[i] = self.read_one(spans[i], done[i] + got)  # a short read: on from there
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
        """End the pool and the ring (reads under way finish first). Idempotent."""
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        if self._ring is not None:
            self._ring.close()

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
        rest.append(memoryview(buf).cast("B")[skip:])
        skip = 0
    return rest
