"""Loaded KV to the model's device from where the store holds it: `PackUpload`.

A full load of packed blocks arrives as `PackView`s (kvstore/load/read_packed.py): each block's
layers in the memory tier's own bytes, page-locked where CUDA is (kvstore/tiers/arena.py). So
the device copy reads them in place: no staging copy on the host, the one copy of the bytes is
the DMA (a view that is not page-locked, e.g. a pack memory could not take, is staged through
the copier's pooled pinned buffers first, and counted).

The copies run on a feeder thread, never on the thread that queues compute: the GPU never waits
for Python to issue the next layer's copy. Layers are copied in groups (`layers_per_copy`: each
DMA moves a block's bytes of several consecutive layers, at least `MIN_COPY_BYTES`, so that small
models do not pay a launch per 192 KiB); per group every block's span goes to a device scratch
in one copy each, then on the copy stream each layer's chunks are rearranged from the stored
chunk-major order, (chunks, 2, heads, c, dim), into the cache's (2, heads, tokens, dim) in the
model's dtype, and the group's event is recorded. Layer L's attention waits for its group's event
only (`wait`), so copying later layers overlaps computing earlier ones.

On the CPU the same code runs with CPU tensors and synchronous copies (the tests count its copies
and check its order); the engine uses it there only when asked (`KVTransfer(staging=True)`).
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvstore.load.buffers import StagingError
from kvstore.load.device import DeviceCopier, torch_dtype
from kvstore.load.read_packed import PackView

#: A device copy moves at least this many bytes of a block where its layers allow (DMA setup
#: costs a few microseconds: a 192 KiB layer of SmolLM2's block would spend much of its time there).
MIN_COPY_BYTES = 4 << 20
#: Layer groups at most: each waits for its own event, so more groups mean more overlap (and more
#: copies: on an H200 1 MiB copies reached 0.60-0.65 of one pinned copy's rate, Python's share).
MAX_GROUPS = 16


@dataclass
class CopyCounts:
    """What one upload copied: device copies, and host bytes staged before them (0 when every view
    was page-locked: each byte then crossed host memory only in the store's own read)."""

    device_copies: int = 0
    staged_bytes: int = 0
    rearranges: int = 0
    order: list[int] = field(default_factory=list)  # layer groups in the order their events were made


def layers_per_copy(view: PackView, num_layers: int) -> int:
    """Consecutive layers one device copy of a block moves (see module docstring)."""
    per_layer = max(view.layer_bytes, 1)
    wanted = -(-MIN_COPY_BYTES // per_layer)
    return max(1, min(num_layers, max(wanted, -(-num_layers // MAX_GROUPS))))


class PackUpload:
    """A full load's KV on its way to `copier.device`: per layer (keys, values) of shape
    (1, kv_heads, tokens, head_dim) in `dtype`, valid once `wait(layer)` returned.

    Args:
        copier: the device, its copy stream and pinned staging pool.
        views: every block of the load, in prompt order (positions ascending).
        num_layers: the model's layers.
        dtype: the model's dtype (the copy converts).
        owner: what keeps the views valid (the load stream), exited once every copy is done.
        targets: where each layer's KV goes, (2, kv_heads, tokens, head_dim) on the device in
            `dtype` (views of larger tensors allowed); default new tensors (`pairs`).

    Raises:
        StagingError: no room on the device for the prefix.
    """

    def __init__(
        self,
        copier: DeviceCopier,
        views: Sequence[PackView],
        num_layers: int,
        dtype: torch.dtype,
        owner: contextlib.AbstractContextManager[Any] | None = None,
        targets: Sequence[torch.Tensor] | None = None,
    ) -> None:
        self.copier, self.views, self.num_layers, self._owner = copier, list(views), num_layers, owner
        two, heads, _, dim = self.views[0].chunk_shape
        self.num_tokens = sum(len(v.positions) for v in self.views)
        self.counts = CopyCounts()
        try:
            self._targets = list(targets) if targets is not None else [
                torch.empty((two, heads, self.num_tokens, dim), dtype=dtype, device=copier.device)
                for _ in range(num_layers)
            ]  # fmt: skip
        except RuntimeError as exc:  # torch.cuda.OutOfMemoryError is one
            self.close()
            raise StagingError(f"no room on {copier.device} for the loaded prefix: {exc}") from exc
        if copier.stream is not None:  # written there: never handed out again before those copies end
            for target in self._targets:
                target.record_stream(copier.stream)
        self.pairs = [(t[0].unsqueeze(0), t[1].unsqueeze(0)) for t in self._targets]
        group = layers_per_copy(self.views[0], num_layers)
        self._groups = [(a, min(a + group, num_layers)) for a in range(0, num_layers, group)]
        self._ready = [threading.Event() for _ in self._groups]
        self._events: list[Any] = [None] * len(self._groups)
        self._error: BaseException | None = None
        with warnings.catch_warnings():  # the tier's bytes are read-only; they are only read here
            warnings.simplefilter("ignore", UserWarning)
            self._sources = [torch.frombuffer(view.data, dtype=torch.uint8) for view in self.views]
        self._pinned = [copier.stream is None or _is_pinned(source) for source in self._sources]
        copier.follow_current()  # the targets' memory may have been in use by compute until now
        # inference mode is per thread: the feeder writes the targets in the mode they were made in
        self._inference = torch.is_inference_mode_enabled()
        self._thread = threading.Thread(target=self._feed, name="kvsieve-upload", daemon=True)
        self._thread.start()

    def group_of(self, layer: int) -> int:
        """The index of the copy group that holds `layer`."""
        return next(i for i, (a, b) in enumerate(self._groups) if a <= layer < b)

    def wait(self, layer: int) -> None:
        """Make the current stream wait for `layer`'s copy (on the CPU: until it is made).

        Raises:
            StagingError: the copy failed (the prefix must then be recomputed).
        """
        index = self.group_of(layer)
        self._ready[index].wait()
        if self._error is not None:
            raise StagingError(f"copying the loaded prefix to {self.copier.device} failed: {self._error}")
        if self._events[index] is not None:
            torch.cuda.current_stream(self.copier.device).wait_event(self._events[index])

    def wait_all(self) -> None:
        """Every layer's copy waited for."""
        for first, _ in self._groups:
            self.wait(first)

    @contextlib.contextmanager
    def attached(self, model: Any) -> Iterator[None]:
        """While inside, each attention layer of `model` waits for its own layer's copy first."""
        hooks = [
            layer.self_attn.register_forward_pre_hook(lambda m, a: self.wait(int(m.layer_idx)))
            for layer in model.model.layers
        ]
        try:
            yield
            self.wait_all()  # a layer the forward did not reach is still made whole
        finally:
            for hook in hooks:
                hook.remove()
            self.close()

    def close(self) -> None:
        """Wait for the feeder, then release the views' owner (the load stream). Idempotent."""
        thread = getattr(self, "_thread", None)
        if thread is not None:
            thread.join()
        if self._owner is not None:
            self._owner.__exit__(None, None, None)
            self._owner = None

    # -- the feeder thread ------------------------------------------------------------------

    def _feed(self) -> None:
        stream = self.copier.stream
        try:
            with (
                torch.inference_mode(self._inference),
                torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext(),
            ):
                for index, (first, end) in enumerate(self._groups):
                    self._copy_group(first, end)
                    if stream is not None:
                        self._events[index] = torch.cuda.Event()
                        self._events[index].record(stream)
                    self.counts.order.append(index)
                    self._ready[index].set()
        except BaseException as exc:  # handed to the waiting compute thread, which recomputes
            self._error = exc
        finally:
            for ready in self._ready:
                ready.set()

    def _copy_group(self, first: int, end: int) -> None:
        """Every block's bytes of layers [first, end) to the device, then each layer rearranged:
        for all blocks at once where they share one geometry (what one store writes), else per block."""
        spans = [view.layer_span(first, end) for view in self.views]
        length = spans[0][1] - spans[0][0]
        itemsize = self.views[0].dtype.itemsize
        uniform = _uniform(self.views) and all(b - a == length for a, b in spans) and length % itemsize == 0
        if uniform:
            scratch = torch.empty((len(self.views), length), dtype=torch.uint8, device=self.copier.device)
            for index, (row, (a, b)) in enumerate(zip(scratch, spans, strict=True)):
                self._to_device(index, a, b, row)
            view = self.views[0]
            for layer in range(first, end):
                offset = view.first + layer * view.layer_stride - spans[0][0]
                self._rearrange(
                    scratch[:, offset : offset + view.layer_bytes], view, layer, 0, self.num_tokens
                )
            return
        tokens = 0
        for index, (view, (a, b)) in enumerate(zip(self.views, spans, strict=True)):
            block = torch.empty((1, b - a), dtype=torch.uint8, device=self.copier.device)
            self._to_device(index, a, b, block[0])
            for layer in range(first, end):
                offset = view.first + layer * view.layer_stride - a
                self._rearrange(
                    block[:, offset : offset + view.layer_bytes], view, layer, tokens, len(view.positions)
                )
            tokens += len(view.positions)

    def _rearrange(self, rows: torch.Tensor, view: PackView, layer: int, start: int, num_tokens: int) -> None:
        """Layer `layer`'s chunks of one or more blocks (`rows`: per row a block's chunk-major bytes of
        the layer) into the target's tokens [start, start + num_tokens), converting to its dtype."""
        blocks = rows.shape[0]
        source = rows.view(torch_dtype(view.dtype)).view(blocks, view.num_chunks, *view.chunk_shape)
        target = self._targets[layer][:, :, start : start + num_tokens]
        two, heads, c, dim = view.chunk_shape
        target.view(two, heads, blocks, view.num_chunks, c, dim).copy_(
            source.permute(2, 3, 0, 1, 4, 5), non_blocking=True
        )
        self.counts.rearranges += 1

    def _to_device(self, index: int, start: int, stop: int, out: torch.Tensor) -> None:
        """Bytes [start, stop) of view `index` into `out` (uint8 on the device): one copy, from the
        view itself when it is page-locked (or on the CPU), else through a pinned staging buffer."""
        source = self._sources[index][start:stop]
        self.counts.device_copies += 1
        if self._pinned[index]:
            out.copy_(source, non_blocking=True)
            return
        buffer = self.copier.pool.take(stop - start)
        staged = buffer[: stop - start]
        staged.copy_(source)
        self.counts.staged_bytes += stop - start
        out.copy_(staged, non_blocking=True)
        event = torch.cuda.Event()
        event.record(self.copier.stream)
        self.copier.pool.give(buffer, event)


def _is_pinned(tensor: torch.Tensor) -> bool:
    """Whether `tensor`'s memory is page-locked (a view of the memory tier's pinned arena is)."""
    try:
        return bool(torch.cuda.is_available() and tensor.is_pinned())
    except RuntimeError:
        return False


def positions_of(views: Sequence[PackView]) -> np.ndarray[Any, Any]:
    """The positions an upload of `views` fills, in slot order."""
    return np.concatenate([v.positions for v in views]) if views else np.zeros(0, np.int64)


def _uniform(views: Sequence[PackView]) -> bool:
    """Whether every view has one geometry (then a layer of all of them is one strided tensor)."""
    first = views[0]
    shape = (first.layer_stride, first.layer_bytes, first.chunk_shape, first.dtype, len(first.positions))
    return all(
        (v.layer_stride, v.layer_bytes, v.chunk_shape, v.dtype, len(v.positions)) == shape for v in views
    )
