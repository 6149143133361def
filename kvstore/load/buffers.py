"""Host buffers for moving KV: glibc malloc tuning, and a pool of staging buffers for devices.

Chunks are 0.1-6 MB. glibc serves allocations above its mmap threshold with
fresh mmap()s, whose pages fault in one by one on first touch, and returns them
on free: every chunk then pays page faults again. Measured here, copying 47 MB
into fresh memory took 150 ms against 6.5 ms into reused memory. Raising the
mmap and trim thresholds keeps freed chunk buffers in the heap for reuse, which
is what jemalloc/tcmalloc deployments get by default.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import threading
from typing import Any

from kvstore.tiers.jobs import JobThread

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def keep_large_buffers(mmap_threshold_bytes: int = 256 << 20, trim_threshold_bytes: int = 1 << 30) -> bool:
    """Raise glibc's mmap and trim thresholds in this process. False where not glibc."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        ok_mmap = libc.mallopt(_M_MMAP_THRESHOLD, mmap_threshold_bytes)
        ok_trim = libc.mallopt(_M_TRIM_THRESHOLD, trim_threshold_bytes)
    except (OSError, AttributeError):
        return False
    return bool(ok_mmap and ok_trim)


class StagingError(RuntimeError):
    """A copy through staging buffers could not be made (no room, or the device failed)."""


class StagingPool:
    """Host buffers that copies to and from a device pass through, reused across loads.

    Page-locked (`pin`) where CUDA is present: DMA reads them directly, so a copy from
    them is asynchronous; page-locking costs milliseconds per buffer, which is why they
    are kept rather than allocated per load. A buffer is handed back with the event of
    the copy still using it and is reused only once that copy finished: a take that finds no
    free buffer waits for a fitting one in flight rather than page-lock another (a DMA ends in
    microseconds), so a steady stream of copies settles on as many buffers as it holds at once. Buffers are
    whole powers of two (>= 64 KiB) so loads of nearby sizes share them.

    Args:
        pin: page-lock the buffers (needs CUDA).
        max_bytes: all buffers together, in use or free, at most this many bytes.

    Thread-safe: an engine takes buffers for its copies while its saver thread gives back those
    of the stores it made.
    """

    MIN_BUFFER_BYTES = 64 << 10

    def __init__(self, pin: bool = False, max_bytes: int = 4 << 30) -> None:
        if max_bytes < self.MIN_BUFFER_BYTES:
            raise ValueError(f"max_bytes must be at least {self.MIN_BUFFER_BYTES}, got {max_bytes}")
        self.pin, self.max_bytes = pin, max_bytes
        self._lock = threading.RLock()
        self._made = threading.Condition(self._lock)  # a buffer made ahead joined the free ones
        self._free: list[Any] = []  # uint8 tensors, ready
        self._busy: list[tuple[Any, Any]] = []  # (buffer, event of the copy using it), oldest first
        self._coming: list[int] = []  # capacities of the buffers being made ahead
        self._maker: JobThread | None = None
        #: Buffers a take allocated so far (tests: none after warm-up), and all buffers' bytes.
        self.allocations = 0
        self.pooled_bytes = 0
        #: Buffers `make_ahead` made, and the thread that made each buffer, in order.
        self.made_ahead = 0
        self.made_on: list[str] = []

    def make_ahead(self, num_bytes: int, count: int = 1) -> None:
        """Have `count` buffers for copies of `num_bytes` made now, page-locked where `pin`, every
        page touched, on a low-priority thread of their own (kvstore/tiers/jobs.py): the copies
        that need them find them ready instead of page-locking in line (0.136 s per 256 MiB on an
        H200's host, issue 47). A take that needs one while it is being made waits for it rather
        than make another. Buffers past `max_bytes` are not made. Returns at once."""
        capacity = _capacity(num_bytes)
        with self._lock:
            count = min(count, (self.max_bytes - self.pooled_bytes) // capacity)
            if count <= 0:
                return
            self.pooled_bytes += count * capacity  # reserved now: a take meanwhile counts them
            self._coming.extend([capacity] * count)
            if self._maker is None:
                self._maker = JobThread("kvsieve-staging-ahead", low_priority=True)
        for _ in range(count):
            self._maker.submit(functools.partial(self._make_one, capacity))

    def wait_ahead(self, timeout_s: float = 30.0) -> bool:
        """Wait until every buffer asked of `make_ahead` is made (tests, benchmarks)."""
        with self._made:
            return self._made.wait_for(lambda: not self._coming, timeout_s)

    def take(self, num_bytes: int) -> Any:
        """A uint8 tensor of at least `num_bytes` bytes, nobody else's until `give`.

        Raises:
            StagingError: it cannot fit under `max_bytes` even after the copies in flight end.
        """
        with self._lock:
            return self._take_locked(num_bytes)

    def _take_locked(self, num_bytes: int) -> Any:
        while True:
            self._collect()
            if (buffer := self._take_free(num_bytes)) is not None:
                return buffer
            fitting = [i for i, (b, _) in enumerate(self._busy) if b.numel() >= num_bytes]
            if fitting:  # a copy in flight ends in microseconds; page-locking a new buffer takes ms
                buffer, event = self._busy.pop(fitting[0])
                event.synchronize()
                return buffer
            if any(c >= num_bytes for c in self._coming):  # being made ahead: sooner than a new one
                self._made.wait()
                continue
            capacity = _capacity(num_bytes)
            if self.pooled_bytes + capacity <= self.max_bytes:
                return self._allocate(capacity)
            if self._free:  # too small for this load: make room for a bigger one
                self.pooled_bytes -= self._free.pop(0).numel()
                continue
            if not self._busy:
                raise StagingError(
                    f"a staging buffer of {num_bytes} bytes does not fit the pool's limit of "
                    f"{self.max_bytes} bytes"
                )
            self._busy[0][1].synchronize()  # wait for the oldest copy, then reuse its buffer

    def give(self, buffer: Any, done: Any = None) -> None:
        """Hand `buffer` back; `done` (a CUDA event) completes when the copy using it ends."""
        with self._lock:
            if done is None:
                self._free.append(buffer)
            else:
                self._busy.append((buffer, done))

    def _collect(self) -> None:
        while self._busy and self._busy[0][1].query():
            self._free.append(self._busy.pop(0)[0])

    def _take_free(self, num_bytes: int) -> Any:
        fits = [i for i, b in enumerate(self._free) if b.numel() >= num_bytes]
        if not fits:
            return None
        best = min(fits, key=lambda i: self._free[i].numel())
        return self._free.pop(best)  # by index: tensors compare elementwise, not by identity

    def _allocate(self, capacity: int) -> Any:
        import torch

        # Host memory by name: a default device set elsewhere (torch.set_default_device) must not move it.
        buffer = torch.empty(capacity, dtype=torch.uint8, device="cpu", pin_memory=self.pin)
        self.allocations += 1
        self.pooled_bytes += capacity
        self.made_on.append(threading.current_thread().name)
        return buffer

    def _make_one(self, capacity: int) -> None:
        """Make one buffer of `make_ahead` (on its thread): outside the lock, then free."""
        import torch

        try:
            buffer = torch.empty(capacity, dtype=torch.uint8, device="cpu", pin_memory=self.pin)
            if not self.pin:
                buffer.zero_()  # its pages faulted in here, not by the first copy into it
        except BaseException:
            with self._made:
                self.pooled_bytes -= capacity
                self._coming.remove(capacity)
                self._made.notify_all()
            raise
        with self._made:
            self._free.append(buffer)
            self._coming.remove(capacity)
            self.made_ahead += 1
            self.made_on.append(threading.current_thread().name)
            self._made.notify_all()


def _capacity(num_bytes: int) -> int:
    """The buffer a copy of `num_bytes` gets: a whole power of two, at least MIN_BUFFER_BYTES."""
    return max(StagingPool.MIN_BUFFER_BYTES, 1 << max(num_bytes - 1, 0).bit_length())
