"""Where the engine computes, and how loaded KV reaches it: `--device cpu|cuda|auto`.

`resolve_device` turns the flag into a torch device. `KVTransfer` moves a loaded
prefix onto it layer by layer (`LayerUpload`): each layer is staged into a pooled
page-locked buffer and copied on the copier's own stream with an event of its own;
a forward pre-hook on each attention module waits for that layer's event only, and
issues the copies of the next `depth` layers, so copying layer L+1 overlaps computing
layer L. Stores go the other way (`download`) on the same stream, waited on after
the answer is decoded. On the CPU the KV is converted in place as before (no staging,
no hooks) unless `staging` asks for the staged path (the tests and `kvsieve bench gpu`).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from engine_adapter.runner.upload import CopyCounts, PackUpload
from kvstore.errors import InvalidInputError
from kvstore.load.buffers import StagingError, StagingPool
from kvstore.load.device import DeviceCopier, PendingDownload, as_array, as_tensor, torch_dtype
from kvstore.load.read_packed import PackView

Array = np.ndarray[Any, Any]
DEVICES = ("cpu", "cuda", "auto")
#: Layers whose copies are issued ahead of the layer being computed.
PREFETCH_LAYERS = 2


def resolve_device(name: str) -> torch.device:
    """The torch device of `--device NAME`: cpu, cuda, cuda:N, or auto (CUDA when present).

    Raises:
        InvalidInputError: an unknown name, or CUDA asked for where torch sees none.
    """
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    base, _, index = name.partition(":")
    if base not in ("cpu", "cuda") or (index and (base == "cpu" or not index.isdigit())):
        raise InvalidInputError(f"--device must be one of cpu, cuda, cuda:N, auto; got {name!r}")
    if base == "cuda" and not torch.cuda.is_available():
        build = torch.version.cuda or "a CPU-only build"
        raise InvalidInputError(
            f"--device {name}: torch sees no CUDA device (torch {torch.__version__}, {build}); "
            "use --device cpu or auto"
        )
    if base == "cuda" and index and int(index) >= torch.cuda.device_count():
        raise InvalidInputError(f"--device {name}: only {torch.cuda.device_count()} CUDA devices")
    return torch.device(name)


class LayerUpload:
    """One loaded prefix on its way to the device: per layer a (keys, values) pair and its copy.

    `pairs[L]` are (1, kv_heads, tokens, head_dim) tensors on the device in the model's
    dtype; they hold the prefix once `wait(L)` returned (on CUDA: once the current
    stream, which `wait` makes wait for layer L's event, reaches them).
    """

    def __init__(
        self,
        copier: DeviceCopier,
        kv: Array,
        order: Array | None,
        dtype: torch.dtype,
        owner: contextlib.AbstractContextManager[Any] | None = None,
    ) -> None:
        self.copier, self.kv, self.order, self._owner = copier, kv, order, owner
        layers, _, heads, tokens, dim = kv.shape
        shape = (2, heads, tokens, dim)
        try:
            self._targets = [torch.empty(shape, dtype=dtype, device=copier.device) for _ in range(layers)]
        except RuntimeError as exc:  # torch.cuda.OutOfMemoryError is one
            self.close()
            raise StagingError(f"no room on {copier.device} for the loaded prefix {kv.shape}: {exc}") from exc
        self.pairs = [(t[0].unsqueeze(0), t[1].unsqueeze(0)) for t in self._targets]
        self._events: list[Any] = []
        copier.follow_current()  # the targets' memory may have been in use by compute until now

    def wait(self, layer: int) -> None:
        """Issue the copies up to `layer` + PREFETCH_LAYERS; make compute wait for `layer`'s.

        Raises:
            StagingError: a copy could not be made (the prefix must then be recomputed).
        """
        self._issue(min(layer + 1 + PREFETCH_LAYERS, len(self._targets)))
        event = self._events[layer]
        if event is not None:
            torch.cuda.current_stream(self.copier.device).wait_event(event)

    def wait_all(self) -> None:
        """Every layer issued, and the current stream waiting for all of them."""
        for layer in range(len(self._targets)):
            self.wait(layer)

    def _issue(self, until: int) -> None:
        while len(self._events) < until:
            layer = len(self._events)
            self._events.append(self.copier.upload(self.kv[layer], self._targets[layer], self.order))

    @contextlib.contextmanager
    def attached(self, model: Any) -> Iterator[None]:
        """While inside, each attention layer of `model` waits for its own layer's copy first."""
        hooks = [
            layer.self_attn.register_forward_pre_hook(self._before_attention) for layer in model.model.layers
        ]
        try:
            self._issue(min(PREFETCH_LAYERS, len(self._targets)))  # under way before compute starts
            yield
            self.wait_all()  # a layer the forward did not reach is still made whole
        finally:
            for hook in hooks:
                hook.remove()
            self.close()

    def close(self) -> None:
        """Release what `kv` belongs to (the load stream): every staged copy is made by now."""
        if self._owner is not None:
            self._owner.__exit__(None, None, None)
            self._owner = None

    def _before_attention(self, module: Any, args: tuple[Any, ...]) -> None:
        self.wait(int(module.layer_idx))


class KVTransfer:
    """The engine's way to its device: uploads of loaded prefixes, downloads of new KV.

    Args:
        device: where the model computes.
        staging: copy through the pooled staging buffers (always on CUDA; on the CPU
            only when asked, to run that path without a device).
        pool: the staging buffers (default: a new pool, page-locked on CUDA).
    """

    def __init__(self, device: torch.device, staging: bool = False, pool: StagingPool | None = None) -> None:
        self.device = device
        self.staged = staging or device.type != "cpu"
        self._pool = pool
        #: Why the last load's copy to the device failed ("" if it did not): it was recomputed.
        self.last_error = ""
        #: What the last `upload_views` copied (the tests and `kvsieve bench gpu` read it).
        self.last_counts: CopyCounts | None = None

    @functools.cached_property
    def copier(self) -> DeviceCopier:
        """The copier (its stream and pool are made on first use)."""
        return DeviceCopier(self.device, self._pool)

    def upload(
        self,
        kv: Array,
        order: Array | None,
        dtype: torch.dtype,
        owner: contextlib.AbstractContextManager[Any] | None = None,
    ) -> LayerUpload:
        """Start moving loaded KV (layers, 2, heads, tokens, dim) to the device, reordered by `order`.

        `owner` (what `kv`'s memory belongs to) is exited once every layer is staged.
        """
        return LayerUpload(self.copier, kv, order, dtype, owner)

    def upload_views(
        self,
        views: Sequence[PackView],
        num_layers: int,
        dtype: torch.dtype,
        owner: contextlib.AbstractContextManager[Any] | None = None,
        targets: Sequence[torch.Tensor] | None = None,
    ) -> PackUpload:
        """Start moving a full load of packed blocks to the device from where the store holds them
        (engine_adapter/runner/upload.py) into `targets` (default new tensors); `owner` is exited
        once every copy is made."""
        upload = PackUpload(self.copier, views, num_layers, dtype, owner, targets)
        self.last_counts = upload.counts
        return upload

    def download(self, kv: torch.Tensor) -> PendingDownload:
        """Start copying `kv` to the host (a pooled buffer); `.result()` waits for it."""
        return self.copier.download(kv)

    def download_layers(
        self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], start: int, end: int, dtype: torch.dtype
    ) -> PendingDownload:
        """Start copying tokens [start, end) of every cache layer's (keys, values) to the host, as
        one (layers, 2, kv_heads, tokens, head_dim) array in `dtype`, on the copy stream, straight
        from the layers (kvstore/load/device.py `DeviceCopier.download_layers`)."""
        return self.copier.download_layers(pairs, start, end, dtype)

    def prepare_downloads(self, num_bytes: int, count: int) -> None:
        """Have `count` buffers for downloads of `num_bytes` made now on a low-priority thread
        (page-locked on CUDA), so that no store's copy off the device allocates in line."""
        self.copier.pool.make_ahead(num_bytes, count)


def copy_into_cache(layer: Any, kv: Array) -> None:
    """Copy a layer's loaded KV (2, heads, tokens, dim) into cache layer `layer`'s tensors, in place.

    The layer-by-layer path's install (engine_adapter/runner/layered.py): on the CPU one
    converting copy per tensor; on CUDA through a staging buffer of the device's shared
    copier, on its copy stream, and the current stream waits for exactly these copies
    (the attention that reads them comes next: the chunks were chosen by its queries).

    Raises:
        StagingError: the copy could not be made (the caller then recomputes the prompt).
    """
    keys, values = layer.keys[0], layer.values[0]
    if keys.device.type == "cpu":
        with warnings.catch_warnings():  # torch warns about read-only arrays; the source is only read
            warnings.simplefilter("ignore", UserWarning)
            source = as_tensor(np.asarray(kv))
        keys.copy_(source[0])  # fp16 -> the model's dtype, in place: the mask stays valid
        values.copy_(source[1])
        return
    copier = _shared_copier(keys.device)
    copier.follow_current()
    stream = torch.cuda.current_stream(keys.device)
    for source, target in ((kv[0], keys), (kv[1], values)):
        stream.wait_event(copier.upload(np.asarray(source), target))


def read_into_cache(layer: Any, read: Any, shape: tuple[int, ...], dtype: Any) -> Any:
    """Read a layer's chosen chunks chunk-major (`read(out)` fills `out`, shape (chunks, 2, kv_heads,
    chunk_tokens, head_dim), and returns what it read) and install them in cache layer `layer`.
    On a device: straight into a page-locked buffer of the device's shared copier, copied from there
    in one copy on the copy stream and put in the cache's order there (`install_chunks`: the host
    copies every byte once and reorders none). On the CPU: into a new array, installed in one
    converting copy per tensor. Returns what `read` returned.

    Raises:
        StagingError: no buffer, or the device refused the copy (the caller recomputes).
    """
    keys = layer.keys[0]
    if keys.device.type == "cpu":
        part = read(None)
        with warnings.catch_warnings():  # torch warns about read-only arrays; the source is only read
            warnings.simplefilter("ignore", UserWarning)
            install_chunks(layer, as_tensor(np.asarray(part.kv)))
        return part
    copier = _shared_copier(keys.device)
    num_bytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    buffer = copier.pool.take(num_bytes)
    host = buffer[:num_bytes].view(torch_dtype(np.dtype(dtype))).view(shape)
    try:
        part = read(as_array(host))
        copier.follow_current()
        event = _install_on(copier, layer, host)
    except BaseException:
        copier.pool.give(buffer)
        raise
    torch.cuda.current_stream(keys.device).wait_event(event)
    copier.pool.give(buffer, event)
    return part


def install_chunks(layer: Any, chunks: torch.Tensor) -> None:
    """Copy chunk-major KV `chunks` (n, 2, kv_heads, chunk_tokens, head_dim), on the cache's device,
    into cache layer `layer` (keys and values (1, kv_heads, n * chunk_tokens, head_dim)) in place,
    in prompt order: one reordering copy per tensor (the mask stays valid)."""
    keys, values = layer.keys[0], layer.values[0]
    heads, tokens, dim = keys.shape
    n = int(chunks.shape[0])
    per = tokens // max(n, 1)
    keys.view(heads, n, per, dim).copy_(chunks[:, 0].permute(1, 0, 2, 3))
    values.view(heads, n, per, dim).copy_(chunks[:, 1].permute(1, 0, 2, 3))


def _install_on(copier: DeviceCopier, layer: Any, host: torch.Tensor) -> Any:
    """Copy page-locked chunk-major `host` to the device and install it in `layer`, both on the copy
    stream; returns the event that ends them.

    Raises:
        StagingError: the device refused the copy.
    """
    device = layer.keys.device
    try:
        with torch.cuda.stream(copier.stream):
            staged = torch.empty(host.shape, dtype=host.dtype, device=device)
            staged.copy_(host, non_blocking=True)
            install_chunks(layer, staged)
            event = torch.cuda.Event()
            event.record(copier.stream)
    except RuntimeError as exc:
        nbytes = host.numel() * host.element_size()
        raise StagingError(f"copying {nbytes} bytes to {device} failed: {exc}") from exc
    return event


@functools.cache
def _shared_copier(device: torch.device) -> DeviceCopier:
    """One copier (pinned pool, copy stream) per device for the layer-by-layer path.

    Process-wide, as torch's own caching allocator is: that path's fillers are built per
    request inside layered.py, where no engine-owned transfer is at hand.
    """
    return DeviceCopier(device)
