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
land in `WarmRanges`: ranges of an arena (the memory tier's own where it has one) whose
segments were made ahead, one segment at a time on a low-priority thread, off the loading
thread; a range freed (the memory tier evicted the record, or nobody kept the read) is reused.
Transparent huge pages would make fresh pages cheap, but asked for here they stalled loads in
compaction (2-5x slower).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from kvstore.tiers.arena import HostArena
from kvstore.tiers.disk.resident import resident, view_at
from kvstore.tiers.disk.spans import SpanReads
from kvstore.tiers.jobs import SegmentsAhead

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
        reader: what reads many spans at once: "threads" or "io_uring" (disk/spans.py).
    """

    def __init__(self, path: Path, warm: WarmRanges | None = None, reader: str = "threads") -> None:
        self._fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        self._inode = os.fstat(self._fd).st_ino
        self._mapping: _Mapping | None = None
        self.warm = warm
        #: Reads of many spans of the file at once (a layer of a query-aware load).
        try:
            self.spans = SpanReads(self._fd, reader=reader)
        except ValueError:
            os.close(self._fd)
            raise

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

    def in_place(self, place: Any, anchor: Any) -> memoryview | None:
        """A value where it lies in the map, read-only, if the page cache holds every page of it
        (kvstore/tiers/disk/resident.py), else None. `place` as `read` takes it (a view into the
        map, or a (file offset, bytes) place); `anchor`: any view into the map (a cursor's key)."""
        if not isinstance(place, tuple):  # a view py-lmdb handed out: its pages were touched
            return memoryview(place).cast("B").toreadonly()
        offset, nbytes = place
        mapping = self._locate([address_range(anchor)])
        if (
            mapping is None
            or not mapping.offset <= offset <= mapping.offset + mapping.end - mapping.start - nbytes
        ):
            return None  # not in the map that holds the anchor (LMDB maps the whole file at once)
        address = mapping.start + offset - mapping.offset
        return view_at(address, nbytes) if resident(address, nbytes) else None

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
        runs = _runs([s for s in spans if s is not None])
        buffers = [self._buffer(end - start) for start, end, _ in runs]
        wanted = [(start, [buf.data]) for (start, _, _), buf in zip(runs, buffers, strict=True)]
        # one run (a block's values: a full load's read) in one call on this thread, as the kernel
        # reads it ahead; several (the summaries of every block of a layer-by-layer load) in parallel
        done = self.spans.read(wanted) if len(runs) > 1 else [self.spans.read_one(w) for w in wanted]
        reads: dict[tuple[int, int], memoryview] = {}
        for (start, end, members), buf, got in zip(runs, buffers, done, strict=True):
            if got != end - start:  # the file ends inside the map: copy these out instead
                return [self._copied(item) for item in items]
            buf.flags.writeable = False
            whole = memoryview(buf.data)
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

    def _buffer(self, nbytes: int) -> np.ndarray[Any, Any]:
        """`nbytes` of memory for a read: a warm range where one is free, else fresh (not zeroed)."""
        buf = self.warm.take(nbytes) if self.warm is not None else None
        return np.empty(nbytes, np.uint8) if buf is None else buf

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
    """Memory for reads whose pages are already there: ranges of a `HostArena` whose segments
    `SegmentsAhead` (kvstore/tiers/jobs.py) makes on a thread of its own, at the lowest priority,
    whenever less than `ahead_bytes` is left free. The arena is the memory tier's where it has one
    (page-locked where CUDA is: a read then lands where a device copies from, and the tier keeps
    it without a copy), else an unpinned one of this reader's. A take never grows the arena
    itself: with no warm range free it returns None (the read then goes to fresh memory).
    Making segments is CPU work all the same (~0.7 ms per MB faulted in here): it pays where the
    thread finds idle time before the loads, e.g. after a restart. Thread-safe.

    Args:
        capacity_bytes: all segments of an arena of its own together at most this many bytes.
        segment_bytes: one segment of an arena of its own.
        ahead: the memory tier's arena with its maker (the store owns and closes it); None:
            an arena of its own.
    """

    #: Smaller reads go to fresh memory: a range is worth it for a block's values, not a record's.
    MIN_BYTES = 1 << 20

    def __init__(
        self, capacity_bytes: int, segment_bytes: int = 64 << 20, ahead: SegmentsAhead | None = None
    ) -> None:
        self._owned = ahead is None
        if ahead is None:
            arena = HostArena(capacity_bytes, pin=False, segment_bytes=segment_bytes)
            ahead = SegmentsAhead(arena, "kvsieve-warm-reads", arena.segment_bytes)
        self.segment_bytes = ahead.arena.segment_bytes
        #: Segments made ahead (one until `keep_ahead` is given more).
        self.ahead = ahead
        self._arena = ahead.arena

    @property
    def ahead_bytes(self) -> int:
        """Free bytes kept made ahead."""
        return self.ahead.ahead_bytes

    def take(self, nbytes: int) -> np.ndarray[Any, Any] | None:
        """A writable warm range of `nbytes` bytes, or None; has the next segment made ahead."""
        if nbytes < self.MIN_BYTES:
            return None
        return self._arena.take(nbytes, grow=False)

    def keep_ahead(self, ahead_bytes: int | None = None) -> None:
        """Have segments made on the thread while less than `ahead_bytes` (given: from now on)
        is free and room is left (never less than the memory tier keeps, if the arena is its)."""
        if ahead_bytes is not None and not self._owned:
            ahead_bytes = max(ahead_bytes, self.ahead.ahead_bytes)
        self.ahead.keep_ahead(ahead_bytes)

    def usage(self) -> Any:
        """The arena's `ArenaUsage`."""
        return self._arena.usage()

    def close(self) -> None:
        """Stop making segments of an arena of its own (the one being made is finished). Idempotent."""
        if self._owned:
            self.ahead.close()
