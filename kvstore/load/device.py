"""Moving KV between host arrays and an accelerator: through pooled staging buffers, asynchronously.

`DeviceCopier` owns a `StagingPool` and, on CUDA, its own copy stream: an upload
stages the host array into a pooled (page-locked) buffer and copies it to the
device with `non_blocking=True` on the copy stream, returning an event that the
compute stream waits on when (and only when) it needs that tensor; a download
copies a device tensor into a pooled buffer on the copy stream, so the host side
(e.g. storing it) can wait for it later, off the critical path. On the CPU the
same calls copy synchronously (events are None): the code path the tests run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvstore.load.buffers import StagingError, StagingPool
from kvstore.model import numpy_dtype
from kvstore.tiers.pinned import cuda_available

Array = np.ndarray[Any, Any]


def to_device(kv: Array, device: str = "cuda") -> Any:
    """A torch tensor of `kv` on `device` (one-off; loads in a loop use `DeviceCopier`).

    On CUDA the array is copied once into page-locked memory and from there by
    DMA (`non_blocking=True`), so the copy overlaps with the caller's work; call
    `torch.cuda.current_stream().synchronize()` (or use the tensor on the same
    stream) before reading it. Elsewhere it returns a CPU tensor that owns its data.
    """
    import torch

    if device == "cpu" or not cuda_available():
        return as_tensor(np.array(kv))  # owns its data: the arena may be reused
    host = as_tensor(np.ascontiguousarray(kv)) if kv.flags.writeable else as_tensor(np.array(kv))
    staging = torch.empty(host.shape, dtype=host.dtype, device="cpu", pin_memory=True)
    staging.copy_(host)
    return staging.to(device, non_blocking=True)


@dataclass
class PendingDownload:
    """A device tensor on its way into a staging buffer; `result` waits and hands back an array."""

    staged: Any  # torch tensor view of `buffer`
    buffer: Any
    event: Any  # CUDA event, or None when the copy is already done
    pool: StagingPool
    source: Any = None  # kept alive until the copy ends: its memory must not be reused meanwhile

    def result(self) -> Array:
        """The tensor's values as a host array the caller owns (waits for the copy)."""
        if self.event is not None:
            self.event.synchronize()
        array = np.array(as_array(self.staged))  # the buffer goes back to the pool: copy out of it
        self.pool.give(self.buffer)
        self.buffer = self.source = None  # given back once only
        return array

    @contextlib.contextmanager
    def held(self) -> Iterator[Array]:
        """The values where the copy put them, in the pooled buffer (waits for the copy): no copy
        out of it; the buffer goes back to the pool when the block ends, so the caller must keep
        no view of it past there (a Store copies what it keeps before it returns)."""
        if self.event is not None:
            self.event.synchronize()
        try:
            yield as_array(self.staged)
        finally:
            self.pool.give(self.buffer)
            self.buffer = self.source = None  # given back once only


class DeviceCopier:
    """Copies between host arrays and one torch device through a `StagingPool`.

    Args:
        device: a torch device (or its name).
        pool: the staging buffers; by default a new pool, page-locked on CUDA.

    Not thread-safe: one engine (one request at a time) owns a copier.
    """

    def __init__(self, device: Any, pool: StagingPool | None = None) -> None:
        import torch

        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.pool = pool if pool is not None else StagingPool(pin=self.cuda)
        #: The stream copies run on (None on CPU): never the compute stream, so a copy
        #: waits for nothing queued there and compute waits only on the copy's event.
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None

    def follow_current(self) -> None:
        """Make later copies wait for the work queued so far on the current (compute) stream.

        Needed before writing device memory that compute may still have been using
        (the caching allocator hands freed blocks out again at once). A no-op on CPU.
        """
        import torch

        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def upload(self, source: Array, target: Any, order: Array | None = None) -> Any:
        """Copy host `source` (positions reordered by `order` along axis -2, if given) into `target`.

        `target` is a tensor on the device, of `source`'s shape and any float dtype (the
        conversion happens in the copy). Returns the copy's CUDA event (None on CPU,
        where the copy is done on return); the compute stream must wait on it before
        reading `target`.

        Raises:
            StagingError: no staging buffer fits, or the device refused the copy (out of
                memory, a CUDA error): `target` must not be used.
        """
        import torch

        buffer = self.pool.take(source.nbytes)
        staged = buffer[: source.nbytes].view(torch_dtype(source.dtype)).view(source.shape)
        if order is None:
            np.copyto(as_array(staged), source)
        else:
            np.take(source, order, axis=-2, out=as_array(staged))
        if self.stream is None:
            target.copy_(staged)
            self.pool.give(buffer)
            return None
        try:
            with torch.cuda.stream(self.stream):
                target.copy_(staged, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self.stream)
        except RuntimeError as exc:  # torch.cuda.OutOfMemoryError is one
            self.pool.give(buffer)
            raise StagingError(f"copying {source.nbytes} bytes to {self.device} failed: {exc}") from exc
        self.pool.give(buffer, event)
        return event

    def upload_pinned(self, source: Any, target: Any) -> Any:
        """Copy `source`, a tensor in page-locked host memory (one of `pool`'s buffers, say), into
        device tensor `target`: no staging copy. Returns the copy's event (None on the CPU, where it
        is done on return); `source` must stay untouched until it completes.

        Raises:
            StagingError: the device refused the copy.
        """
        import torch

        if self.stream is None:
            target.copy_(source)
            return None
        try:
            with torch.cuda.stream(self.stream):
                target.copy_(source, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self.stream)
        except RuntimeError as exc:
            raise StagingError(
                f"copying {source.numel() * source.element_size()} bytes to {self.device} failed: {exc}"
            ) from exc
        return event

    def download(self, source: Any) -> PendingDownload:
        """Start copying device tensor `source` to the host; `.result()` waits for it.

        On CUDA the copy stream first waits for the work queued so far on the current
        stream (which computed `source`), then copies into a pooled buffer.

        Raises:
            StagingError: as for `upload`.
        """
        import torch

        num_bytes = source.numel() * source.element_size()
        buffer = self.pool.take(num_bytes)
        staged = buffer[:num_bytes].view(source.dtype).view(source.shape)
        if self.stream is None:
            staged.copy_(source)
            return PendingDownload(staged, buffer, None, self.pool)
        try:
            self.follow_current()  # `source` was computed there
            with torch.cuda.stream(self.stream):
                staged.copy_(source, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self.stream)
        except RuntimeError as exc:
            self.pool.give(buffer)
            raise StagingError(f"copying {num_bytes} bytes from {self.device} failed: {exc}") from exc
        return PendingDownload(staged, buffer, event, self.pool, source)

    def download_layers(
        self, pairs: Sequence[tuple[Any, Any]], start: int, end: int, dtype: Any
    ) -> PendingDownload:
        """Start copying tokens [start, end) of every layer's (keys, values), each (1, kv_heads,
        tokens, head_dim) on the device, into one pooled buffer as (layers, 2, kv_heads, end -
        start, head_dim) in torch dtype `dtype`; `.result()` or `.held()` waits for it. The layers
        go where they lie, each on the copy stream (CPU: here): no stack of them on the device, no
        new host memory where the pool has a buffer ready (`StagingPool.make_ahead`).

        Raises:
            StagingError: as for `upload`.
        """
        return _download_layers(self, pairs, start, end, dtype)


def _download_layers(
    copier: DeviceCopier, pairs: Sequence[tuple[Any, Any]], start: int, end: int, dtype: Any
) -> PendingDownload:
    """`DeviceCopier.download_layers` (see there)."""
    import torch

    layers, (_, heads, _, dim) = len(pairs), pairs[0][0].shape
    shape = (layers, 2, heads, end - start, dim)
    num_bytes = layers * 2 * heads * (end - start) * dim * dtype.itemsize
    buffer = copier.pool.take(num_bytes)
    staged = buffer[:num_bytes].view(dtype).view(shape)
    if copier.stream is None:
        for layer, (keys, values) in enumerate(pairs):
            staged[layer, 0].copy_(keys[0, :, start:end])
            staged[layer, 1].copy_(values[0, :, start:end])
        return PendingDownload(staged, buffer, None, copier.pool)
    try:
        copier.follow_current()  # the KV was computed there
        with torch.cuda.stream(copier.stream):
            for layer, (keys, values) in enumerate(pairs):
                staged[layer, 0].copy_(keys[0, :, start:end], non_blocking=True)
                staged[layer, 1].copy_(values[0, :, start:end], non_blocking=True)
            event = torch.cuda.Event()
            event.record(copier.stream)
    except RuntimeError as exc:
        copier.pool.give(buffer)
        raise StagingError(f"copying {num_bytes} bytes from {copier.device} failed: {exc}") from exc
    return PendingDownload(staged, buffer, event, copier.pool, list(pairs))


def torch_dtype(dtype: np.dtype[Any]) -> Any:
    """The torch dtype of a numpy dtype (bfloat16, which numpy lacks, from ml_dtypes' by name)."""
    import torch

    if dtype.name == "bfloat16":
        return torch.bfloat16
    return torch.from_numpy(np.empty(0, dtype=dtype)).dtype


def as_tensor(array: Array) -> Any:
    """A CPU tensor sharing `array`'s memory (bfloat16 through an int16 view: torch cannot read
    ml_dtypes' bfloat16 arrays, and numpy has none of its own)."""
    import torch

    if array.dtype.name == "bfloat16":
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def as_array(tensor: Any) -> Array:
    """A numpy array sharing a CPU tensor's memory (bfloat16 as ml_dtypes' bfloat16)."""
    import torch

    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(numpy_dtype("bfloat16"))
    return tensor.numpy()
