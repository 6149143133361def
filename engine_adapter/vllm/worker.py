"""Worker side of the vLLM connector: moves KV between the sidecar and vLLM's paged cache.

The cache may be in any layout `layout.detect` knows, on the CPU or a CUDA device.

Loads are fetched from the sidecar before the forward pass (`start_load`). On a
CPU cache they are written there too, synchronously: the forward pass and the
copy compete for the same cores anyway. On a CUDA cache each layer's KV goes
through a pinned host buffer and a side stream (`staging`) into the cache, and
the layer's attention waits for its own copy only (`wait_layer`, vLLM's
`wait_for_layer_load`): copying layer L+1 overlaps computing layer L. A load that
fails or comes back short marks the affected vLLM blocks as failed, and vLLM
recomputes them.

Saves copy the new blocks out of vLLM's cache before vLLM may reuse them, one
indexed copy per layer; a background thread (`sender.SaveQueue`) sends the copy,
so no step waits for the sidecar. On a CPU cache the copy is made after the
forward pass (`save`, vLLM's `wait_for_save`). On a CUDA cache each layer's
blocks are gathered on the device as soon as the layer is computed (`save_layer`,
vLLM's `save_kv_layer`), and copied to pinned host memory on the side stream; the
sender waits for that copy's event, never the forward pass.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Mapping

import numpy as np
import torch

from engine_adapter.vllm import layout
from engine_adapter.vllm.guard import SidecarGuard
from engine_adapter.vllm.jobs import LoadOutcome, SaveJob, layer_order
from engine_adapter.vllm.plan import LoadOp, SaveOp
from engine_adapter.vllm.sender import SaveQueue
from engine_adapter.vllm.settings import DEFAULT_SAVE_QUEUE_BYTES
from engine_adapter.vllm.staging import CopyStream, HostStaging
from engine_adapter.vllm.timings import TimingLog
from kvstore.api import PrefixStore
from kvstore.errors import InvalidInputError
from kvstore.model import ModelSpec


class WorkerSide:
    """The connector's worker half, called from vLLM's model runner thread.

    Its saves are sent by a thread of its own (`saves`), which calls only `_send`.

    Args:
        client: the store: a `KVClient`, or any thread-safe `PrefixStore` (an embedded one in tests).
        spec: the model's identity and KV shape.
        namespace: tenant of every call.
        block_size: tokens per vLLM cache block.
        guard: the circuit breaker around sidecar calls (shared by both threads).
        save_queue_bytes: bound on the bytes of KV copies waiting to be sent.
        copy_timeout_s: CUDA: how long the sender waits for a save's copy out of the cache.
        timings: where each load's fetch and copy times and each save's copy time are recorded.
    """

    def __init__(
        self,
        client: PrefixStore,
        spec: ModelSpec,
        namespace: str,
        block_size: int,
        guard: SidecarGuard,
        save_queue_bytes: int = DEFAULT_SAVE_QUEUE_BYTES,
        copy_timeout_s: float = 10.0,
        timings: TimingLog | None = None,
    ):
        self.client = client
        self.spec = spec
        self.namespace = namespace
        self.block_size = block_size
        self.guard = guard
        self.copy_timeout_s = copy_timeout_s
        self.timings = timings or TimingLog(None)
        self.layers: list[torch.Tensor] = []
        self.saves: SaveQueue[SaveJob] = SaveQueue(self._send, save_queue_bytes, guard.log)
        self.saved_blocks = 0  # new blocks the sidecar wrote (counted on the sender thread)
        self._block_bytes = 0  # one vLLM block of every layer
        self._failed_blocks: set[int] = set()
        self._step_failed = False
        self._copy_failed = False  # logged once
        self.layout = layout.cpu_layout(spec.head_dim)
        self.layer_index: dict[str, int] = {}
        self.device = torch.device("cpu")
        self.staging = HostStaging(pin=False)
        self.copies: CopyStream | None = None  # set when the cache is on CUDA
        self._layer_loaded: dict[int, torch.cuda.Event] = {}  # CUDA: the step's load, per layer
        self._loads_in_flight: list[tuple[torch.cuda.Event, list[torch.Tensor]]] = []
        self._step_saves: list[SaveJob] | None = None  # CUDA: this step's saves, copied per layer

    def register(
        self, kv_caches: Mapping[str, torch.Tensor], cache_layout: layout.CacheLayout | None = None
    ) -> None:
        """Take vLLM's per-layer cache tensors in `cache_layout` (default: the CPU backend's);
        check them against the model spec.

        Raises:
            InvalidInputError: layer count, heads, head size, block size, dtype or layout disagree
                with the spec, or the layers are not all on one device.
        """
        cache_layout = cache_layout or layout.cpu_layout(self.spec.head_dim)
        names = layer_order(list(kv_caches))
        layers = [kv_caches[name] for name in names]
        if len(layers) != self.spec.num_layers:
            raise InvalidInputError(
                f"vLLM has {len(layers)} KV cache layers, the model spec {self.spec.num_layers}"
            )
        if cache_layout.head_dim != self.spec.head_dim:
            raise InvalidInputError(
                f"vLLM's cache layout has head_dim {cache_layout.head_dim}, "
                f"the model spec {self.spec.head_dim}"
            )
        for layer in layers:
            cache_layout.check(layer, self.spec.num_kv_heads, self.block_size)
            if layout.dtype_name(layer.dtype) != self.spec.dtype:
                raise InvalidInputError(
                    f"vLLM KV cache is {layer.dtype}, the model spec says {self.spec.dtype}"
                )
            if layer.device != layers[0].device:
                raise InvalidInputError(f"vLLM KV cache layers on {layer.device} and {layers[0].device}")
        self.layers = layers
        self.layout = cache_layout
        self.layer_index = {name: i for i, name in enumerate(names)}
        self.device = layers[0].device
        on_cuda = self.device.type == "cuda"
        self.staging = HostStaging(pin=on_cuda)
        self.copies = CopyStream(self.device) if on_cuda else None
        self._block_bytes = sum(layer.nbytes // layer.shape[cache_layout.block_axis] for layer in layers)

    def start_load(self, ops: tuple[LoadOp, ...]) -> list[LoadOutcome]:
        """Run every load of the step; failures are remembered for `take_failed_blocks`."""
        outcomes = []
        self._step_failed = False
        self._step_saves = None
        if self.copies is not None:
            self._reclaim_load_buffers()
            self._join_loads()
            if ops:
                self.copies.after_compute()
        for op in ops:
            written = self.guard.call("load", functools.partial(self._load, op))
            outcome = self._outcome(op, written or 0)
            if outcome.failed_blocks and written is not None:
                self.guard.log.warning(
                    "kvsieve sidecar delivered %d of %d prefix tokens (a corrupt or evicted block): "
                    "vLLM recomputes the rest",
                    outcome.written_tokens,
                    op.end - op.start,
                )
            self._failed_blocks |= outcome.failed_blocks
            self._step_failed |= bool(outcome.failed_blocks)
            outcomes.append(outcome)
        return outcomes

    def save(self, ops: tuple[SaveOp, ...]) -> int:
        """Copy every save of the step out of the cache and queue it; the number queued.

        Returns once the copies are made (vLLM may then reuse the blocks); the
        sender thread stores them. A save that does not fit in the queue is
        dropped and counted (`saves.stats()`), never waited for. Nothing is stored
        in a step where a load failed: tokens computed in it attended to blocks
        that were never filled, so their KV is wrong (vLLM recomputes them, and a
        later request stores the blocks).
        """
        if self.copies is not None:
            return self._finish_device_saves(ops)
        if self._step_failed or not self.guard.available:  # breaker open: the send would be skipped
            return 0
        queued = 0
        with self.timings.span("save_copy") as record:
            for op in ops:
                try:
                    queued += self._queue(op)
                except Exception:  # a bug of ours must cost the save, not the request
                    self._log_copy_failure()
            record["saves"] = queued
        return queued

    def wait_layer(self, layer_name: str) -> None:
        """CUDA: make the compute stream wait for this layer's load (the host does not wait)."""
        event = self._layer_loaded.pop(self.layer_index.get(layer_name, -1), None)
        if event is not None:
            CopyStream.compute_waits_for(event)

    def save_layer(self, layer_name: str, ops: tuple[SaveOp, ...]) -> None:
        """CUDA: gather this layer's blocks of the step's saves on the device, right after the layer
        is computed, and copy them to pinned host memory on the side stream (nothing waits).

        On a CPU cache this does nothing: `save` copies every layer after the forward pass.
        """
        if self.copies is None or not ops:
            return
        if self._step_saves is None:
            self._step_saves = self._start_device_saves(ops)
        index = self.layer_index.get(layer_name)
        if index is not None:
            for job in self._step_saves:
                self._copy_layer_out(job, index)

    def flush(self, timeout_s: float) -> bool:
        """Wait until the queued saves are sent; False if the deadline passed first."""
        return self.saves.flush(timeout_s)

    def close(self, timeout_s: float) -> bool:
        """Send the queued saves within `timeout_s`, drop the rest, stop the sender; True if stopped."""
        stopped = self.saves.close(timeout_s)
        stats = self.saves.stats()
        if stats.sent or stats.dropped:
            self.guard.log.info(
                "kvsieve saves: %d sent (%d new blocks), %d dropped; sender %s",
                stats.sent,
                self.saved_blocks,
                stats.dropped,
                "stopped" if stopped else "still sending past its deadline",
            )
        return stopped

    def take_failed_blocks(self) -> set[int]:
        """vLLM block ids whose load failed since the last call (then forgotten)."""
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def _load(self, op: LoadOp) -> int:
        """Write positions [op.start, op.end) from the sidecar; the end of the contiguous run written."""
        t0 = time.perf_counter()
        with self.client.load(
            np.asarray(op.tokens, np.uint32), model=self.spec, namespace=self.namespace, budget=1.0
        ) as stream:
            positions, kv = stream.gather(self.spec)
            t_fetched = time.perf_counter()
            # A corrupt or vanished block ends the stream early: only [start, covered) is valid.
            covered = min(int(stream.num_tokens), op.end)
            keep = (positions >= op.start) & (positions < covered)
            if not keep.all():
                positions, kv = positions[keep], kv[:, :, :, keep]
            if len(positions) != max(0, covered - op.start):
                raise InvalidInputError(
                    f"sidecar delivered {len(positions)} of the {covered - op.start} positions asked for"
                )
            slots = layout.slots_of(positions, op.block_table, self.block_size)
            if self.copies is None:
                layout.scatter(self.layers, layout.from_numpy(kv), slots, self.layout)
            else:
                self._load_to_device(layout.from_numpy(kv), slots, self.copies)
        if self.timings.enabled:
            done = time.perf_counter()
            self.timings.record("load", fetch_s=t_fetched - t0, copy_s=done - t_fetched,
                                tokens=len(positions), bytes=int(kv.nbytes))  # fmt: skip
        return covered

    def _load_to_device(self, kv: torch.Tensor, slots: layout.Slots, copies: CopyStream) -> None:
        """Queue each layer's KV host -> pinned -> device -> cache on the side stream, with one event
        per layer (`wait_layer`). Only the copy into pinned memory makes the host wait: `kv` may be
        a view of the sidecar's shared memory, valid only until the load's stream closes."""
        buffers = []
        with torch.cuda.stream(copies.stream):
            slots_on_device = slots.to(self.device)
            for i, layer in enumerate(self.layers):
                pinned = self.staging.take(tuple(kv.shape[1:]), layer.dtype)
                pinned.copy_(kv[i])
                layer_kv = pinned.to(self.device, non_blocking=True)
                layout.scatter_layer(layer, layer_kv, slots_on_device, self.layout)
                self._layer_loaded[i] = copies.event()
                buffers.append(pinned)
        self._loads_in_flight.append((copies.event(), buffers))

    def _join_loads(self) -> None:
        """Make the compute stream wait for loads whose layer vLLM did not wait for (no attention
        metadata for it): no later kernel may read a block still being written."""
        for event in self._layer_loaded.values():
            CopyStream.compute_waits_for(event)
        self._layer_loaded.clear()

    def _reclaim_load_buffers(self) -> None:
        """Return the pinned buffers of finished loads to the pool."""
        still = []
        for event, buffers in self._loads_in_flight:
            if event.query():
                for buffer in buffers:
                    self.staging.give(buffer)
            else:
                still.append((event, buffers))
        self._loads_in_flight = still

    def _start_device_saves(self, ops: tuple[SaveOp, ...]) -> list[SaveJob]:
        """Reserve queue room and a pinned buffer for each save of the step (CUDA)."""
        jobs: list[SaveJob] = []
        if self._step_failed or not self.guard.available:
            return jobs
        for op in ops:
            try:
                first, block_ids = self._save_blocks(op)
                make = functools.partial(self._device_job, op, first, block_ids, jobs)
                self.saves.offer(len(block_ids) * self._block_bytes, make)
            except Exception:  # a bug of ours must cost the save, not the request
                self._log_copy_failure()
        return jobs

    def _device_job(self, op: SaveOp, first: int, block_ids: tuple[int, ...], jobs: list[SaveJob]) -> SaveJob:
        """A CUDA save with its pinned buffer, to be filled layer by layer (added to `jobs`)."""
        shape = layout.block_copy_shape(self.layers[0], len(block_ids), self.layout, len(self.layers))
        blocks = self.staging.take(shape, self.layers[0].dtype)
        offset = op.kv_start - first * self.block_size
        ids = torch.as_tensor(block_ids, dtype=torch.int64).to(self.device)
        job = SaveJob(op.tokens, op.kv_start, blocks, offset, block_ids, threading.Event(), None, set(), ids)
        jobs.append(job)
        return job

    def _copy_layer_out(self, job: SaveJob, index: int) -> None:
        """Gather one layer's blocks of `job` on the compute stream (ordered after the layer's
        writes; the gathered tensor is ours, so vLLM may reuse the blocks at once) and copy it to
        the job's pinned buffer on the side stream."""
        assert self.copies is not None and job.layers_done is not None and job.device_block_ids is not None
        if index in job.layers_done:
            return
        gathered = torch.index_select(self.layers[index], self.layout.block_axis, job.device_block_ids)
        self.copies.after_compute()
        with torch.cuda.stream(self.copies.stream):
            job.blocks[index].copy_(gathered, non_blocking=True)
        gathered.record_stream(self.copies.stream)  # not reused until the copy is done
        job.layers_done.add(index)

    def _finish_device_saves(self, ops: tuple[SaveOp, ...]) -> int:
        """End of the step (CUDA): copy the layers vLLM did not hand to `save_layer`, record the
        event the sender waits for, and release the jobs to it."""
        self._join_loads()
        jobs = self._step_saves if self._step_saves is not None else self._start_device_saves(ops)
        self._step_saves = None
        assert self.copies is not None
        for job in jobs:
            try:
                for index in range(len(self.layers)):
                    self._copy_layer_out(job, index)
                job.copied = self.copies.event()
            except Exception:
                self._log_copy_failure()  # the sender finds no event and drops the save
            finally:
                assert job.ready is not None
                job.ready.set()
        return len(jobs)

    def _log_copy_failure(self) -> None:
        if not self._copy_failed:
            self.guard.log.exception("kvsieve could not copy a save out of vLLM's cache")
        self._copy_failed = True

    def _outcome(self, op: LoadOp, written_end: int) -> LoadOutcome:
        """Blocks of [op.start, op.end) not entirely written are failed (vLLM recomputes from the first)."""
        first_bad = max(op.start, written_end)
        bad = range(first_bad // self.block_size, -(-op.end // self.block_size))
        return LoadOutcome(max(0, written_end - op.start), frozenset(op.block_table[i] for i in bad))

    def _save_blocks(self, op: SaveOp) -> tuple[int, tuple[int, ...]]:
        """Index of the first vLLM block of `op`'s KV in its block table, and the blocks holding it."""
        first, end = op.kv_start // self.block_size, -(-len(op.tokens) // self.block_size)
        if end > len(op.block_table):
            raise InvalidInputError(
                f"save of {len(op.tokens)} tokens past the request's {len(op.block_table)} blocks"
            )
        return first, tuple(op.block_table[first:end])

    def _queue(self, op: SaveOp) -> bool:
        """Offer `op` to the queue: copied (here, now) if it fits; whether it was queued."""
        first, block_ids = self._save_blocks(op)

        def copy() -> SaveJob:
            blocks = layout.copy_blocks(self.layers, block_ids, self.layout)
            return SaveJob(op.tokens, op.kv_start, blocks, op.kv_start - first * self.block_size)

        return self.saves.offer(len(block_ids) * self._block_bytes, copy)

    def _send(self, job: SaveJob) -> None:
        """Store one copied save (the sender thread)."""
        if job.ready is not None:
            # CUDA: the model runner queued the copies; wait for them here, never in the step.
            if not job.ready.wait(self.copy_timeout_s) or job.copied is None:
                # The buffer is not returned to the pool: a copy may still land in it.
                self.guard.log.warning("kvsieve save dropped: its copy out of vLLM's cache did not finish")
                return
            job.copied.synchronize()
        try:
            with self.timings.span("store", tokens=len(job.tokens) - job.kv_start):
                new_blocks = self.guard.call("store", functools.partial(self._store, job))
            self.saved_blocks += new_blocks or 0
        finally:
            if job.ready is not None:
                self.staging.give(job.blocks)

    def _store(self, job: SaveJob) -> int:
        num_tokens = len(job.tokens) - job.kv_start
        kv = layout.blocks_to_kv(job.blocks, self.layout, job.offset, num_tokens)
        tokens, start = np.asarray(job.tokens, np.uint32), job.kv_start
        result = self.client.store(tokens, kv, model=self.spec, namespace=self.namespace, kv_start=start)
        return int(result.new_blocks)
