"""A prefill that computes the head of a cached prefix while its tail loads (engine_adapter/runner/
choice.py chooses where): `prefill_split`.

The tail's blocks are read on a thread of their own (from disk: the slow part), while this thread
queues the head's forward pass on the device; then the tail goes to the device from where the store
holds it (`PackUpload`) into its place beside the head's KV, and the question is computed on top of
both, each layer's attention waiting for its own layer of the tail. Whatever of the tail
is lost on the way (a block gone or corrupt) is computed instead: the answer never depends on it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from engine_adapter.runner.attention import AttentionStats
from engine_adapter.runner.cache import cache_from, empty_cache
from engine_adapter.runner.choice import SplitPlan
from engine_adapter.runner.prefill import Prefill, PrefillEngine, Timings, forward, report_history, store_new
from kvstore.load.buffers import StagingError
from kvstore.load.read_packed import PackView
from kvstore.load.stream import LocalLoadStream
from kvstore.store.tiered import TieredStore


class DeviceTimer:
    """Seconds of the device's work between construction and `stop`, read once it is done: CUDA
    events on a GPU (nothing waits in between), the clock on the CPU (where work is synchronous)."""

    def __init__(self, device: torch.device) -> None:
        self._events = None
        self._t0, self._seconds = time.perf_counter(), 0.0
        if device.type == "cuda":
            self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self._events[0].record()

    def stop(self) -> None:
        """The end of the timed work (queued after it, on a GPU)."""
        if self._events is not None:
            self._events[1].record()
        else:
            self._seconds = time.perf_counter() - self._t0

    def seconds(self) -> float:
        """The timed work's seconds (on a GPU, waits for it to finish)."""
        if self._events is None:
            return self._seconds
        self._events[1].synchronize()
        return float(self._events[0].elapsed_time(self._events[1])) / 1e3


class _TailReader:
    """Reads a load's `PackView`s on a thread of its own; `join` hands them over."""

    def __init__(self, stream: LocalLoadStream) -> None:
        self.stream, self.seconds = stream, 0.0
        self.views: list[PackView] = []
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._read, name="kvsieve-tail-read", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        t0 = time.perf_counter()
        try:
            views = self.stream.pack_views()
            self.views = [] if views is None else list(views)
        except BaseException as exc:  # handed to the request, which then computes the tail
            self.error = exc
        self.seconds = time.perf_counter() - t0

    def join(self) -> list[PackView]:
        self._thread.join()
        return self.views


def prefill_split(engine: PrefillEngine, ids: Sequence[int], plan: SplitPlan, timings: Timings) -> Prefill:
    """Compute prefix tokens [0, plan.compute_tokens) while [compute_tokens, prefix_tokens) load,
    then the rest of the prompt on top; store and report as `prefill_static` does."""
    lm, store = engine.lm, engine.store
    assert isinstance(store, TieredStore)
    head, prefix = plan.compute_tokens, plan.prefix_tokens
    t0 = time.perf_counter()
    stream = store.load(ids[:prefix], model=lm.spec, namespace=engine.namespace, start_token=head)
    engine.last_load = stream
    reader = _TailReader(stream)
    cache = empty_cache(lm.model.config)
    head_timer = DeviceTimer(lm.device)
    forward(lm, ids[:head], 0, cache, None, last_only=True)  # queued while the tail is read
    head_timer.stop()
    views = reader.join()
    if reader.error is not None:  # the tail is computed instead (a block lost or corrupt on the way)
        engine.transfer.last_error = f"reading the prefix's tail failed: {reader.error}"
    timings.lookup_s, timings.load_s = 0.0, reader.seconds
    from_disk = sum(v.nbytes for v in views if v.tier != "memory")
    if views and from_disk * 2 >= sum(v.nbytes for v in views):  # mostly the disk's: its rate
        engine.costs.observe_read("disk", from_disk, reader.seconds)
    covered = head + sum(len(v.positions) for v in views)
    stats = AttentionStats(covered, lm.spec.num_layers) if engine.collect_stats else None
    try:
        logits, cache = _question(engine, ids, covered, cache, views, stream, stats)
    except StagingError as exc:  # the tail could not reach the device: computed instead
        engine.transfer.last_error = str(exc)
        stream.close()
        cache = empty_cache(lm.model.config)
        covered, views = 0, []
        logits = forward(lm, ids, 0, cache, stats := None, last_only=True)
    timings.prefill_s = time.perf_counter() - t0 - timings.load_s
    loaded = covered - head if views else 0
    state = Prefill(cache, logits[0, -1], len(ids), covered, loaded, len(ids) - loaded, timings=timings)
    # A prefill of `head` tokens from scratch: what recomputing costs, seen at a length that the
    # question's few tokens never show (a GPU computes a long batch far faster per token).
    engine.costs.observe_prefill(head, 0, head_timer.seconds())
    t_store = time.perf_counter()
    state.pending_store = store_new(engine, ids, covered, cache, stats)
    if stats is not None and covered:
        report_history(engine, ids[:covered], stats)
    timings.store_s = time.perf_counter() - t_store
    return state


def _question(
    engine: PrefillEngine, ids: Sequence[int], covered: int, cache: Any, views: list[PackView],
    stream: LocalLoadStream, stats: AttentionStats | None,
) -> tuple[torch.Tensor, Any]:  # fmt: skip
    """The prompt after the tail, on top of head and tail; and the cache holding all three. Each
    layer's whole prefix is one tensor: the head's KV copied in, the tail's copied to its place from
    where the store holds it (`PackUpload`), each layer's attention waiting for its own copy."""
    lm = engine.lm
    if not views:
        stream.close()
        return forward(lm, ids[covered:], covered, cache, stats, last_only=True), cache
    head = int(cache.layers[0].keys.shape[-2])
    whole = []
    for layer in cache.layers:  # (2, kv_heads, covered, head_dim): the head now, the tail to come
        two = torch.empty(
            (2, *layer.keys.shape[1:2], covered, layer.keys.shape[-1]), dtype=lm.dtype, device=lm.device
        )
        two[0, :, :head] = layer.keys[0]
        two[1, :, :head] = layer.values[0]
        whole.append(two)
    upload = engine.transfer.upload_views(
        views, lm.spec.num_layers, lm.dtype, owner=stream, targets=[t[:, :, head:] for t in whole]
    )
    cache = cache_from(lm.model.config, [(t[0].unsqueeze(0), t[1].unsqueeze(0)) for t in whole])
    with upload.attached(lm.model):
        return forward(lm, ids[covered:], covered, cache, stats, last_only=True), cache
