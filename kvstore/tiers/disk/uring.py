"""Many spans of one file read through io_uring: a deep queue of reads from the calling thread.

A layer-by-layer load reads, per layer, tens to hundreds of runs of 32-64 KiB scattered over the
data file (kvstore/tiers/disk/spans.py). A disk serves such reads faster the more of them it has
in flight, and a pool of threads keeps only as many in flight as it has threads, each costing a
thread switch per read. A ring keeps up to `DEPTH` in flight from one thread. Measured here, cold,
random offsets of a 1 GiB file, the same spans (docs/performance.md, issue 46's second round): 32 KiB reads at
677 MB/s with 8 threads of `preadv`, 795 with 32, 790 through a ring at depth 32, 1,161 at 128;
128 KiB reads at 1.07-1.19 GB/s all. A real layer-by-layer load, alternated in one process, was
13 % faster through the ring at 4k tokens and 10-15 % slower at 16k: the pool stays the default
(`StoreConfig.disk_reader`). KvikIO (`kvikio-cu12` 26.10) installs on the CPU machine, but its reads
fail there without libcuda.so.1, even into host memory: not measured.

The ring is the `liburing` package's (wheels for x86-64 Linux). Where it is missing, or the kernel
refuses a ring (io_uring disabled, a seccomp filter), `open_ring` returns None and asking for the
ring is refused with a clear error. Each read lands straight in the caller's buffers (`readv`); its
result is checked: an error raises after every read in flight has completed (none writes into a
buffer afterwards), a short read is finished by the caller from where it stopped.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import threading
from collections.abc import Sequence
from typing import Any

try:  # optional: wheels for x86-64 Linux only
    import liburing
except ImportError:  # pragma: no cover - depends on the platform
    liburing = None

#: Reads in flight at once (the ring's size).
DEPTH = 128

Span = tuple[int, Sequence[memoryview]]


class UringReads:
    """Reads spans of file descriptor `fd` through one io_uring ring. Thread-safe: one caller's
    reads at a time (the ring's queue is deep enough for the disk on its own). `close` ends it.

    Raises:
        OSError: the kernel refused a ring (use `open_ring`, which says None instead).
    """

    def __init__(self, fd: int, depth: int = DEPTH) -> None:
        if liburing is None:
            raise OSError("the liburing package is not installed")
        self._fd, self._depth = fd, depth
        self._ring, self._cqe = liburing.Ring(), liburing.Cqe()
        liburing.io_uring_queue_init(depth, self._ring)
        self._lock = threading.Lock()
        self._open = True

    def read(self, spans: Sequence[Span]) -> list[int]:
        """Fill each span's buffers from its file offset; the bytes each read returned: fewer than
        asked where one came back short (the file's end, or a read to finish from there).

        Raises:
            OSError: a read failed (every read in flight completed first), or the ring is closed.
        """
        with self._lock:
            if not self._open:
                raise OSError("the io_uring reader is closed")
            return self._read(spans)

    def _read(self, spans: Sequence[Span]) -> list[int]:
        ring, cqe = self._ring, self._cqe
        done = [0] * len(spans)
        vectors: list[Any] = []  # every read's vector, alive until all have completed
        failed: OSError | None = None
        queued = in_flight = 0
        while (queued < len(spans) and failed is None) or in_flight:
            while queued < len(spans) and in_flight < self._depth and failed is None:
                offset, buffers = spans[queued]
                vectors.append(liburing.Iovec(list(buffers)))
                sqe = liburing.io_uring_get_sqe(ring)
                liburing.io_uring_prep_readv(sqe, self._fd, vectors[-1], offset)
                liburing.io_uring_sqe_set_data64(sqe, queued)
                queued, in_flight = queued + 1, in_flight + 1
            try:
                liburing.io_uring_submit_and_wait(ring, 1)
            except OSError as exc:  # a signal, or the kernel short of room for a moment: again
                if exc.errno not in (errno.EINTR, errno.EAGAIN, errno.EBUSY):
                    raise
            while liburing.io_uring_cq_ready(ring):
                in_flight -= 1
                try:  # the binding raises for a read that failed: its entry is skipped then
                    liburing.io_uring_wait_cqe(ring, cqe)  # one is ready: returns at once
                    entry = cqe[0]
                    done[int(entry.user_data)] = max(int(entry.res), 0)
                    liburing.io_uring_cqe_seen(ring, entry)
                except OSError as exc:
                    liburing.io_uring_cq_advance(ring, 1)
                    failed = failed or OSError(exc.errno, f"reading the data file: {exc.strerror}")
        if failed is not None:
            raise failed
        return done

    def close(self) -> None:
        """End the ring (a read under way finishes first). Idempotent."""
        with self._lock:
            if self._open:
                self._open = False
                liburing.io_uring_queue_exit(self._ring)


@functools.cache
def ring_available() -> bool:
    """Whether a ring can be had here (liburing installed, the kernel gives one), tried once."""
    ring = open_ring(-1, depth=2)
    if ring is not None:
        ring.close()
    return ring is not None


def open_ring(fd: int, depth: int = DEPTH) -> UringReads | None:
    """A ring reading `fd`, or None where none can be had (no liburing, the kernel refuses one)."""
    if liburing is None:
        return None
    with contextlib.suppress(OSError, RuntimeError, ValueError):
        return UringReads(fd, depth)
    return None
