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
    """A pool of host buffers, pinned when `pin`, reused by byte size. Thread-safe.

    Args:
        pin: page-lock the buffers (the cache is on a CUDA device).
        keep_per_size: free buffers kept per size; more are released.
    """

    def __init__(self, pin: bool, keep_per_size: int = 4) -> None:
        self.pin = pin
        self.keep_per_size = keep_per_size
        self.allocated = 0  # buffers ever created (a warm pool stops counting)
        self._free: dict[int, list[torch.Tensor]] = defaultdict(list)
        self._lock = threading.Lock()

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A host tensor of `shape` and `dtype` (contents undefined), pinned when the pool pins."""
        nbytes = _numel(shape) * torch.empty((), dtype=dtype).element_size()
        with self._lock:
            free = self._free.get(nbytes)
            raw = free.pop() if free else None
        if raw is None:
            raw = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)
            with self._lock:
                self.allocated += 1
        return raw.view(dtype).view(shape)

    def give(self, buffer: torch.Tensor) -> None:
        """Return a buffer from `take` (no copy may still be reading or writing it)."""
        raw = buffer.view(-1).view(torch.uint8)
        with self._lock:
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


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
