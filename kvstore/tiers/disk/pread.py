"""Reading LMDB values with pread instead of page faults.

LMDB returns a value as an address in its memory map; copying it out faults the
pages in one readahead window at a time, each fault holding the GIL. Measured
here, cold, that reached a third of what `read` of the same bytes does. So a
read transaction only locates the values (their addresses, no byte touched),
and `MapReader` turns each address into an offset in the data file and reads
the values with one `pread` per run of adjacent values (a block's chunks are
adjacent: their keys sort together and one transaction wrote them in order).
The caller holds the read transaction meanwhile, so LMDB reuses none of those
pages; every value is still verified by its checksum after the read.

What a cold load reads becomes the memory tier's copy (promotion keeps the bytes read), so
each read used to land in memory the process never touched, faulted in 4 KiB at a time: the
biggest cost of a cold hit here, 1,540 faults and 4.5-10 ms per 6 MB block, 30-35 ms of a
47 MB load (fresh pages cost ~2.5 us each on this VM, whether faulted or populated). So reads
land in `WarmRanges`: ranges of an arena whose segments were faulted in ahead, one segment
at a time on the read-ahead thread, off the loading thread; a range freed (the memory tier
evicted the record, or nobody kept the read) is reused warm. Transparent huge pages would
make fresh pages cheap, but asked for here they stalled loads in compaction (2-5x slower).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import os
import queue
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from kvstore.tiers.arena import HostArena
from kvstore.tiers.disk.spans import SpanReads

logger = logging.getLogger(__name__)

# Values closer than this in the file are read together (the bytes between are page headers).
MERGE_GAP = 64 << 10


class _Mapping(NamedTuple):
    start: int
    end: int
    offset: int


def address_range(buf: Any) -> tuple[int, int]:
    """(address, length) of a buffer that points into a mapping (no byte of it is read)."""
    arr = np.frombuffer(buf, np.uint8)
    return int(arr.ctypes.data), int(arr.nbytes)


def find_mapping(inode: int, address: int, maps: str = "/proc/self/maps") -> _Mapping | None:
    """The mapping of file `inode` that contains `address`, from /proc/self/maps (Linux)."""
    try:
        lines = Path(maps).read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) < 5 or fields[4] != str(inode):
            continue
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        if lo <= address < hi:
            return _Mapping(lo, hi, int(fields[2], 16))
    return None


class MapReader:
    """Reads values that lie in a memory map of `path` through a file descriptor.

    Args:
        path: the LMDB data file the environment maps.
        warm: where reads of runs of at least `WarmRanges.MIN_BYTES` land (None: fresh memory).
    """

    def __init__(self, path: Path, warm: WarmRanges | None = None) -> None:
        self._fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        self._inode = os.fstat(self._fd).st_ino
        self._mapping: _Mapping | None = None
        self.warm = warm
        #: Reads of many spans of the file at once (a layer of a query-aware load).
        self.spans = SpanReads(self._fd)

    def file_span(self, first: Any, nbytes: int) -> tuple[int, int] | None:
        """(offset, nbytes) of the data file from where value `first` lies, or None when the
        value is not in a mapping of the file (no byte of it is read)."""
        span = address_range(first)
        mapping = self._locate([span])
        if mapping is None:
            return None
        return span[0] - mapping.start + mapping.offset, nbytes

    def will_need(self, spans: list[tuple[int, int]]) -> None:
        """Have the kernel read these (offset, nbytes) spans of the file (posix_fadvise
        WILLNEED). Blocks until the reads are queued: call it off the loading thread."""
        if hasattr(os, "posix_fadvise"):
            for offset, nbytes in spans:
                os.posix_fadvise(self._fd, offset, nbytes, os.POSIX_FADV_WILLNEED)

    @property
    def mapped(self) -> bool:
        """Whether a read has found the map (and so reads values with pread)."""
        return self._mapping is not None

    def invalidate(self) -> None:
        """Forget where the map lies (LMDB may move it when the map size changes)."""
        self._mapping = None

    def read(self, items: list[Any]) -> list[memoryview | None]:
        """Immutable copies of values, read from the file where possible: each item a view into the
        map, a (file offset, bytes) place (kvstore/tiers/disk/locate.py), or None (stays None)."""
        views = [v for v in items if v is not None and not isinstance(v, tuple)]
        mapping = self._locate([address_range(v) for v in views]) if views else None
        if views and mapping is None:  # not a mapping of our file (or no /proc): copy those out
            return [self._copied(item) for item in items]
        spans = [self._file_place(item, mapping) for item in items]
        reads: dict[tuple[int, int], memoryview] = {}
        for start, end, members in _runs([s for s in spans if s is not None]):
            whole = self._read(end - start, start)
            if len(whole) != end - start:  # the file ends inside the map: copy these out instead
                return [self._copied(item) for item in items]
            for offset, length in members:
                reads[(offset, length)] = whole[offset - start : offset - start + length]
        return [None if s is None else reads[s] for s in spans]

    def _file_place(self, item: Any, mapping: _Mapping | None) -> tuple[int, int] | None:
        if item is None or isinstance(item, tuple):
            return item
        assert mapping is not None
        address, length = address_range(item)
        return address - mapping.start + mapping.offset, length

    def _copied(self, item: Any) -> memoryview | None:
        if item is None:
            return None
        if isinstance(item, tuple):
            return memoryview(os.pread(self._fd, item[1], item[0]))
        return memoryview(bytes(item))

    def slices(self, value: Any, ranges: Sequence[tuple[int, int]]) -> list[memoryview]:
        """Immutable copies of byte ranges [start, end) of one value (clipped at its end), read from
        the file where the value lies in its map, else copied out of the map."""
        span = self.file_span(value, len(value))
        if span is None:
            return [memoryview(bytes(value[start:end])) for start, end in ranges]
        out = []
        for start, end in ranges:
            start, end = min(start, len(value)), min(end, len(value))
            out.append(
                memoryview(os.pread(self._fd, end - start, span[0] + start))
                if end > start
                else memoryview(b"")
            )
        return out

    def _read(self, nbytes: int, offset: int) -> memoryview:
        """`nbytes` of the file from `offset` (fewer at its end), read-only, in a warm range
        where one is free, else in fresh memory."""
        buf = self.warm.take(nbytes) if self.warm is not None else None
        if buf is None:
            return memoryview(os.pread(self._fd, nbytes, offset))
        whole = memoryview(buf.data)  # numpy's buffer, typed for os.preadv
        got = os.preadv(self._fd, [whole], offset)
        buf.flags.writeable = False
        return whole.toreadonly()[:got]

    def close(self) -> None:
        """Close the file descriptor. Idempotent."""
        self.spans.close()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _locate(self, spans: list[tuple[int, int]]) -> _Mapping | None:
        if not spans:
            return None
        lo, hi = min(a for a, _ in spans), max(a + n for a, n in spans)
        m = self._mapping
        if m is None or not (m.start <= lo and hi <= m.end):
            m = self._mapping = find_mapping(self._inode, lo)
        if m is None or not (m.start <= lo and hi <= m.end):
            return None
        return m


def _runs(spans: list[tuple[int, int]]) -> list[tuple[int, int, list[tuple[int, int]]]]:
    """(start, end, spans) of runs of spans no further than MERGE_GAP apart, in file order."""
    runs: list[tuple[int, int, list[tuple[int, int]]]] = []
    for addr, length in sorted(set(spans)):
        if runs and addr <= runs[-1][1] + MERGE_GAP:
            start, end, members = runs[-1]
            runs[-1] = (start, max(end, addr + length), [*members, (addr, length)])
        else:
            runs.append((addr, addr + length, [(addr, length)]))
    return runs


class WarmRanges:
    """Memory for reads whose pages are already faulted in: an unpinned `HostArena` that
    segments are added to, made and faulted in on a thread of its own, whenever less than
    `ahead_bytes` is left free. A take never grows the arena itself: with no warm range free it
    returns None (the read then goes to fresh memory, as before). Faulting in is CPU work all
    the same (~0.7 ms per MB here): it pays where the thread finds idle time before the loads,
    e.g. after a restart (`kvsieve serve` makes `StoreConfig.warm_read_ahead_bytes` at
    start); its thread runs at the lowest priority. Thread-safe.

    Args:
        capacity_bytes: all segments together at most this many bytes.
        segment_bytes: one segment.
    """

    #: Smaller reads go to fresh memory: a range is worth it for a block's values, not a record's.
    MIN_BYTES = 1 << 20

    def __init__(self, capacity_bytes: int, segment_bytes: int = 64 << 20) -> None:
        self.segment_bytes = segment_bytes
        #: Free warm bytes to keep made ahead (one segment until `keep_ahead` is given more).
        self.ahead_bytes = segment_bytes
        self._arena = HostArena(capacity_bytes, pin=False, segment_bytes=segment_bytes)
        # A thread of its own: queued behind the read-ahead hints it would delay the next load's.
        self._hints = HintThread("kvsieve-warm-reads")
        self._lock = threading.Lock()
        self._growing = False
        self._niced = False

    def take(self, nbytes: int) -> np.ndarray[Any, Any] | None:
        """A writable warm range of `nbytes` bytes, or None; makes the next segment ahead."""
        if nbytes < self.MIN_BYTES:
            return None
        out = self._arena.take(nbytes, grow=False)
        self.keep_ahead()
        return out

    def keep_ahead(self, ahead_bytes: int | None = None) -> None:
        """Have segments made on the hints' thread while less than `ahead_bytes` (given: from now
        on) is free and room is left."""
        if ahead_bytes is not None:
            self.ahead_bytes = ahead_bytes
        usage = self._arena.usage()
        if usage.segment_bytes - usage.used_bytes >= self.ahead_bytes:
            return
        if usage.segment_bytes + self.segment_bytes > self._arena.capacity_bytes:
            return
        with self._lock:
            if self._growing:
                return
            self._growing = True
        self._hints.submit(self._grow)

    def usage(self) -> Any:
        """The arena's `ArenaUsage`."""
        return self._arena.usage()

    def close(self) -> None:
        """Stop making segments (the one being made is finished). Idempotent."""
        self._hints.close()

    def _grow(self) -> None:
        if not self._niced:  # the loads and the engine beside us go first (Linux: per thread)
            self._niced = True
            with contextlib.suppress(OSError, AttributeError):
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        try:
            # A mapping of its own, not numpy's: numpy asks for huge pages for an array this large,
            # and in the sidecar faulting those in cost 3x the CPU of 4 KiB pages (compaction).
            buf = mmap.mmap(-1, self.segment_bytes, flags=mmap.MAP_PRIVATE)
            segment = np.frombuffer(buf, np.uint8)
            # Written before anyone can take a range of it; ctypes lets go of the GIL meanwhile.
            ctypes.memset(segment.ctypes.data, 0, segment.size)
            self._arena.add_segment(segment)
        finally:
            with self._lock:
                self._growing = False
        self.keep_ahead()  # the loads meanwhile may have taken it already


class HintThread:
    """One daemon thread that runs read-ahead hints in order, off the loading thread.

    Locating a load's values faults the B-tree pages in cold, one block at a time, and
    posix_fadvise blocks until its reads are queued: measured here, hinting a cold
    47 MB load on the loading thread delayed its first chunk 29-60 ms, about the time
    of all the reads, so nothing overlapped. Run here, the hints read ahead while the
    loading thread verifies and copies the blocks already read.
    """

    def __init__(self, name: str) -> None:
        self._name = name
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
        while (job := self._jobs.get()) is not None:
            if self._closed:  # closing: the loads these hints were for are over
                continue
            try:
                job()
            except Exception:  # a hint only: one that fails must not end the hints after it
                logger.debug("read-ahead hint failed", exc_info=True)
