"""Host memory for the memory tier carved out of a few large segments, page-locked once each.

Where CUDA exists the memory tier keeps its records in page-locked memory, so that a load can
copy them to the GPU by DMA straight from where they lie. Page-locking is the expensive part:
`cudaHostAlloc` costs far more per byte than copying (a 16k prefix of an 8B-shaped model took
15.4 s to store against its 4.5 s prefill when every record was pinned on its own, issue #40).
So the arena pins memory a segment at a time (`segment_bytes`, 256 MiB by default), once, and
hands out ranges of it; a freed range is reused by later records.

A range is freed when the last reference to its array goes, not when the tier deletes it: a load
may still hold views of an evicted record (the tier promises that slices stay valid after an
eviction), and reusing those bytes under it would hand back another block's KV. The arrays are
weakly referenced; their finalizer queues the range, and the next allocation returns it to the
free list under the lock (a finalizer can run inside an allocation, which must not re-enter it).

Without CUDA the same arena runs on plain memory (`pin=False`): the tests prove its bookkeeping
on the CPU, and a store may use it there to avoid heap fragmentation.

Making a segment is what costs (page-locking 256 MiB took 0.136 s on an H200's host; plain pages
fault in at ~2.5 us each here), so a store hands its arena's growth to `SegmentsAhead`
(kvstore/tiers/jobs.py), which makes segments on a low-priority thread before they are needed:
from then on `take` never makes one (`grow_ahead`), and the thread that made each segment is
recorded (`segment_threads`: the tests check that no load made one). What a cold load reads
lands in the arena too, and the memory tier keeps those very bytes (`keep`): no copy, no new
memory on the load's path.
"""

from __future__ import annotations

import bisect
import collections
import ctypes
import mmap
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

Array = np.ndarray[Any, Any]

#: Ranges start on this boundary (a page: DMA engines and memcpy both like aligned starts).
ALIGN = 4096


@dataclass(frozen=True)
class ArenaUsage:
    """What an arena holds: bytes in live ranges, bytes of its segments, segments made."""

    used_bytes: int
    segment_bytes: int
    segments: int


class HostArena:
    """Ranges of host memory from large segments; see module docstring. Thread-safe.

    Args:
        capacity_bytes: all segments together at most this many bytes (a record that does not
            fit then gets None from `copy_in`, and the caller keeps it elsewhere).
        pin: page-lock the segments (needs torch with CUDA).
        segment_bytes: the size of one segment; a larger record gets a segment of its own size.
    """

    def __init__(self, capacity_bytes: int, pin: bool, segment_bytes: int = 256 << 20) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        if segment_bytes < ALIGN:
            raise ValueError(f"segment_bytes must be at least {ALIGN}, got {segment_bytes}")
        self.capacity_bytes, self.pin, self.segment_bytes = capacity_bytes, pin, segment_bytes
        self._segments: list[Array] = []
        self._owners: list[Any] = []  # what keeps each segment's memory (a pinned torch tensor)
        self._free: list[list[tuple[int, int]]] = []  # per segment: sorted (start, length)
        self._used = 0
        self._freed: collections.deque[tuple[int, int, int]] = collections.deque()  # from finalizers
        self._made_on: list[str] = []  # the thread that made each segment
        self._after_take: Callable[[], None] | None = None  # set: segments are made ahead, not here
        self._lock = threading.Lock()

    def copy_in(self, data: bytes | memoryview | Array) -> Array | None:
        """`data` copied into a range of the arena, as a read-only uint8 array; None if it does not
        fit under `capacity_bytes`. The range is reused once the array and every view of it are gone."""
        src = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data.view(np.uint8)
        out = self.take(int(src.size))
        if out is None:
            return None
        out[:] = src.reshape(-1)
        out.flags.writeable = False
        return out

    def take(self, nbytes: int, grow: bool = True) -> Array | None:
        """A writable range of `nbytes` bytes (uint8) for the caller to fill (then to make read-only);
        None if it does not fit under `capacity_bytes`, or, with `grow` False, in the segments made
        so far. Reused once the array and every view of it are gone."""
        after = self._after_take
        with self._lock:
            self._return_freed()
            place = self._take(nbytes, grow and after is None)
        if after is not None:
            after()
        if place is None:
            return None
        segment, start = place
        out = self._segments[segment][start : start + nbytes]
        weakref.finalize(out, self._freed.append, (segment, start, _rounded(nbytes)))
        return out

    def keep(self, data: bytes | memoryview | Array) -> Array | None:
        """`data` as a read-only uint8 array of this arena: `data` itself when it is a read-only
        view of a range `take` handed out (what a cold load read there: kept without a copy, its
        range freed once every view of it is gone), else a copy (`copy_in`, None if it does not fit)."""
        src = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data.view(np.uint8)
        if not src.flags.writeable and src.size and self._holds(_first_byte(src), int(src.size)):
            return src.reshape(-1)
        return self.copy_in(src)

    def grow_ahead(self, after_take: Callable[[], None]) -> None:
        """From now on `take` makes no segment (`make_segment` does, on the caller's thread) and
        calls `after_take` after each take (outside the lock), so that a thread can keep room ahead."""
        self._after_take = after_take

    def make_segment(self) -> bool:
        """Make one segment of `segment_bytes` now, its pages faulted in (page-locked where `pin`),
        as free room. False, and nothing made, if it would pass `capacity_bytes`. Slow: call it
        off the loading thread (`SegmentsAhead`)."""
        with self._lock:
            if sum(int(s.size) for s in self._segments) + self.segment_bytes > self.capacity_bytes:
                return False
        segment, owner = _made_segment(self.segment_bytes, self.pin)  # outside the lock: slow
        with self._lock:
            if sum(int(s.size) for s in self._segments) + segment.size > self.capacity_bytes:
                return False  # another thread grew it meanwhile
            self._add_locked(segment, owner)
            self._free[-1] = [(0, int(segment.size))]
        return True

    def segment_threads(self) -> list[str]:
        """The name of the thread that made each segment, in the order they were made."""
        with self._lock:
            return list(self._made_on)

    def add_segment(self, segment: Array) -> bool:
        """Add `segment` (uint8, made and faulted in by the caller; pin=False only) as free room;
        False, and nothing added, if it would pass `capacity_bytes`."""
        if self.pin:
            raise ValueError("add_segment is for unpinned arenas")
        with self._lock:
            if sum(int(s.size) for s in self._segments) + segment.size > self.capacity_bytes:
                return False
            self._add_locked(segment, segment)
            self._free[-1] = [(0, int(segment.size))]
            return True

    def usage(self) -> ArenaUsage:
        """Bytes in live ranges (freed ranges whose arrays are gone no longer count), segment bytes."""
        with self._lock:
            self._return_freed()
            return ArenaUsage(self._used, sum(int(s.size) for s in self._segments), len(self._segments))

    def is_arena_memory(self, array: Array) -> bool:
        """Whether `array`'s first byte lies in one of this arena's segments."""
        address = array.__array_interface__["data"][0]
        with self._lock:
            return any(_first_byte(s) <= address < _first_byte(s) + s.size for s in self._segments)

    def _holds(self, address: int, nbytes: int) -> bool:
        """Whether [address, address + nbytes) lies inside one segment."""
        with self._lock:
            return any(
                _first_byte(s) <= address and address + nbytes <= _first_byte(s) + s.size
                for s in self._segments
            )

    # -- bookkeeping (under the lock) ---------------------------------------------------------

    def _take(self, size: int, grow: bool = True) -> tuple[int, int] | None:
        length = _rounded(size)
        for segment, free in enumerate(self._free):
            for i, (start, room) in enumerate(free):
                if room >= length:
                    free[i : i + 1] = [(start + length, room - length)] if room > length else []
                    self._used += length
                    return segment, start
        made = max(self.segment_bytes, length)
        if not grow or sum(int(s.size) for s in self._segments) + made > self.capacity_bytes:
            return None
        self._new_segment(made)
        self._free[-1] = [(length, made - length)] if made > length else []
        self._used += length
        return len(self._segments) - 1, 0

    def _new_segment(self, num_bytes: int) -> None:
        owner: Any
        if self.pin:
            import torch

            owner = torch.empty(num_bytes, dtype=torch.uint8, device="cpu", pin_memory=True)
            segment: Array = owner.numpy()
        else:
            owner = segment = np.empty(num_bytes, np.uint8)
        self._add_locked(segment, owner)

    def _add_locked(self, segment: Array, owner: Any) -> None:
        self._segments.append(segment)
        self._owners.append(owner)
        self._free.append([])
        self._made_on.append(threading.current_thread().name)

    def _return_freed(self) -> None:
        while self._freed:
            segment, start, length = self._freed.popleft()
            self._used -= length
            _insert_free(self._free[segment], start, length)


def _made_segment(num_bytes: int, pin: bool) -> tuple[Array, Any]:
    """A segment with its pages in memory, and what owns its memory."""
    if pin:
        import torch

        owner = torch.empty(num_bytes, dtype=torch.uint8, device="cpu", pin_memory=True)  # resident
        return owner.numpy(), owner
    # A mapping of its own, not numpy's: numpy asks for huge pages for an array this large, and in
    # the sidecar faulting those in cost 3x the CPU of 4 KiB pages (compaction).
    buf = mmap.mmap(-1, num_bytes, flags=mmap.MAP_PRIVATE)
    segment = np.frombuffer(buf, np.uint8)
    ctypes.memset(segment.ctypes.data, 0, segment.size)  # faulted in; ctypes lets go of the GIL
    return segment, buf


def _rounded(size: int) -> int:
    return max(ALIGN, -(-size // ALIGN) * ALIGN)


def _first_byte(array: Array) -> int:
    return int(array.__array_interface__["data"][0])


def _insert_free(free: list[tuple[int, int]], start: int, length: int) -> None:
    """Put [start, start + length) back into the sorted free list, joined with its neighbours."""
    i = bisect.bisect_left(free, (start, 0))
    if i < len(free) and free[i][0] == start + length:  # the next range follows it
        length += free.pop(i)[1]
    if i > 0 and free[i - 1][0] + free[i - 1][1] == start:  # it follows the previous range
        start, length = free[i - 1][0], free[i - 1][1] + length
        i -= 1
        free.pop(i)
    free.insert(i, (start, length))
