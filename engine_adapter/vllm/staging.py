"""Host staging of the connector's copies between the sidecar and a vLLM cache on a GPU.

A copy between host memory and a CUDA device is asynchronous only from pinned
(page-locked) host memory; from pageable memory the driver stages it itself and
the host waits. Pinning is costly (a driver call per allocation), so buffers
come from a pool and go back to it, never allocated per step once warm.

`CopyStream` is the side CUDA stream these copies run on, so they overlap the
forward pass on vLLM's compute stream; ordering between the two is by events
only (`after_compute`, `event`), never by making the host wait.

On a CPU cache nothing here pins or streams: `HostStaging(pin=False)` hands out
plain tensors, and the worker copies synchronously.
"""

from __future__ import annotations

import threading
from collections import defaultdict

import torch


class HostStaging:
    """A pool of host buffers, pinned when `pin`, reused across steps. Thread-safe.

    Buffers are kept in power-of-two size classes, so loads and saves of varying
    lengths reuse the same few allocations (at most twice the bytes asked for).

    Args:
        pin: page-lock the buffers (the cache is on a CUDA device).
        keep_per_size: free buffers kept per size class; more are released.
    """

    def __init__(self, pin: bool, keep_per_size: int = 4) -> None:
        self.pin = pin
        self.keep_per_size = keep_per_size
        self.allocated = 0  # buffers ever created (a warm pool stops counting)
        self._free: dict[int, list[torch.Tensor]] = defaultdict(list)
        self._lent: dict[int, torch.Tensor] = {}  # data pointer -> the whole buffer it starts
        self._lock = threading.Lock()

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A host tensor of `shape` and `dtype` (contents undefined), pinned when the pool pins."""
        nbytes = _numel(shape) * torch.empty((), dtype=dtype).element_size()
        size = max(_MIN_BYTES, 1 << max(0, nbytes - 1).bit_length())
        with self._lock:
            free = self._free.get(size)
            raw = free.pop() if free else None
        created = raw is None
        if raw is None:
            raw = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
        with self._lock:
            self.allocated += created
            self._lent[raw.data_ptr()] = raw
        return raw[:nbytes].view(dtype).view(shape)

    def give(self, buffer: torch.Tensor) -> None:
        """Return a buffer from `take` (no copy may still be reading or writing it)."""
        with self._lock:
            raw = self._lent.pop(buffer.data_ptr(), None)
            if raw is None:
                return
            free = self._free[raw.numel()]
            if len(free) < self.keep_per_size:
                free.append(raw)


class CopyStream:
    """A side CUDA stream for the connector's copies, ordered against the compute stream by events.

    Args:
        device: the CUDA device of vLLM's cache.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)

    def after_compute(self) -> None:
        """Make later copies on this stream wait for the work queued so far on the compute stream
        (blocks freed by a finished request may still be read by it); the host does not wait."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def event(self) -> torch.cuda.Event:
        """An event recorded now on this stream: done when the copies queued so far are."""
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    @staticmethod
    def compute_waits_for(event: torch.cuda.Event) -> None:
        """Make the compute stream's later work wait for `event` (the host does not wait)."""
        torch.cuda.current_stream().wait_event(event)


_MIN_BYTES = 4096


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
