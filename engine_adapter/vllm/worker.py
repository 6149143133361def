"""Worker side of the vLLM connector: moves KV between the sidecar and vLLM's paged cache.

Loads run before the forward pass (`start_load`), synchronously: on CPU the
forward pass and the copy compete for the same cores anyway. A load that fails or
comes back short marks the affected vLLM blocks as failed, and vLLM recomputes them.

Saves run after the forward pass (`save`), when every layer's KV of the step is
in the cache. Only their copy is synchronous: the new blocks are copied out of
vLLM's cache (one indexed copy per layer) before `save` returns, since vLLM may
reuse them right after; a background thread (`sender.SaveQueue`) sends the copy,
so no step waits for the sidecar.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from typing import NamedTuple

import numpy as np
import torch

from engine_adapter.vllm import layout
from engine_adapter.vllm.guard import SidecarGuard
from engine_adapter.vllm.plan import LoadOp, SaveOp
from engine_adapter.vllm.sender import SaveQueue
from engine_adapter.vllm.settings import DEFAULT_SAVE_QUEUE_BYTES
from kvstore.api import PrefixStore
from kvstore.errors import InvalidInputError
from kvstore.model import ModelSpec


class LoadOutcome(NamedTuple):
    """What one load wrote: the tokens placed and the vLLM blocks that must be recomputed."""

    written_tokens: int
    failed_blocks: frozenset[int]


class SaveJob(NamedTuple):
    """One save, copied out of vLLM's cache: what the sender thread stores.

    Attributes:
        tokens: the prefix stored (whole kvsieve blocks).
        kv_start: first position whose KV is sent.
        blocks: copy of the vLLM blocks holding [kv_start, len(tokens)) (`layout.copy_blocks`).
        offset: where kv_start lies in the copy (its offset in the first copied block).
    """

    tokens: tuple[int, ...]
    kv_start: int
    blocks: torch.Tensor
    offset: int


def layer_order(names: list[str]) -> list[str]:
    """Layer names sorted by the layer number they contain ("model.layers.12.self_attn.attn")."""

    def number(name: str) -> int:
        found = re.findall(r"\.(\d+)\.", f".{name}.")
        if len(found) != 1:
            raise InvalidInputError(f"cannot tell the layer number of KV cache layer {name!r}")
        return int(found[0])

    return sorted(names, key=number)


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
    """

    def __init__(
        self,
        client: PrefixStore,
        spec: ModelSpec,
        namespace: str,
        block_size: int,
        guard: SidecarGuard,
        save_queue_bytes: int = DEFAULT_SAVE_QUEUE_BYTES,
    ):
        self.client = client
        self.spec = spec
        self.namespace = namespace
        self.block_size = block_size
        self.guard = guard
        self.layers: list[torch.Tensor] = []
        self.saves: SaveQueue[SaveJob] = SaveQueue(self._send, save_queue_bytes, guard.log)
        self.saved_blocks = 0  # new blocks the sidecar wrote (counted on the sender thread)
        self._block_bytes = 0  # one vLLM block of every layer
        self._failed_blocks: set[int] = set()
        self._step_failed = False
        self._copy_failed = False  # logged once

    def register(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        """Take vLLM's per-layer cache tensors; check them against the model spec.

        Raises:
            InvalidInputError: layer count, heads, head size or dtype disagree with the spec.
        """
        layers = [kv_caches[name] for name in layer_order(list(kv_caches))]
        if len(layers) != self.spec.num_layers:
            raise InvalidInputError(
                f"vLLM has {len(layers)} KV cache layers, the model spec {self.spec.num_layers}"
            )
        for layer in layers:
            view = layout.paged_view(layer, self.spec.head_dim)
            if view.shape[1] != self.spec.num_kv_heads or view.shape[3] != self.block_size:
                raise InvalidInputError(
                    f"vLLM KV cache layer {tuple(layer.shape)} does not match "
                    f"{self.spec.num_kv_heads} KV heads in blocks of {self.block_size}"
                )
            if layout.dtype_name(layer.dtype) != self.spec.dtype:
                raise InvalidInputError(
                    f"vLLM KV cache is {layer.dtype}, the model spec says {self.spec.dtype}"
                )
        self.layers = layers
        self._block_bytes = sum(layer[0].nbytes for layer in layers)

    def start_load(self, ops: tuple[LoadOp, ...]) -> list[LoadOutcome]:
        """Run every load of the step; failures are remembered for `take_failed_blocks`."""
        outcomes = []
        self._step_failed = False
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
        if self._step_failed or not self.guard.available:  # breaker open: the send would be skipped
            return 0
        queued = 0
        for op in ops:
            try:
                queued += self._queue(op)
            except Exception:  # a bug of ours must cost the save, not the request
                if not self._copy_failed:
                    self.guard.log.exception("kvsieve could not copy a save out of vLLM's cache")
                self._copy_failed = True
        return queued

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
        with self.client.load(
            np.asarray(op.tokens, np.uint32), model=self.spec, namespace=self.namespace, budget=1.0
        ) as stream:
            positions, kv = stream.gather(self.spec)
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
            layout.scatter(self.layers, layout.from_numpy(kv), slots, self.spec.head_dim)
        return covered

    def _outcome(self, op: LoadOp, written_end: int) -> LoadOutcome:
        """Blocks of [op.start, op.end) not entirely written are failed (vLLM recomputes from the first)."""
        first_bad = max(op.start, written_end)
        bad = range(first_bad // self.block_size, -(-op.end // self.block_size))
        return LoadOutcome(max(0, written_end - op.start), frozenset(op.block_table[i] for i in bad))

    def _queue(self, op: SaveOp) -> bool:
        """Offer `op` to the queue: copied (here, now) if it fits; whether it was queued."""
        first, end = op.kv_start // self.block_size, -(-len(op.tokens) // self.block_size)
        if end > len(op.block_table):
            raise InvalidInputError(
                f"save of {len(op.tokens)} tokens past the request's {len(op.block_table)} blocks"
            )
        block_ids = op.block_table[first:end]

        def copy() -> SaveJob:
            blocks = layout.copy_blocks(self.layers, block_ids)
            return SaveJob(op.tokens, op.kv_start, blocks, op.kv_start - first * self.block_size)

        return self.saves.offer(len(block_ids) * self._block_bytes, copy)

    def _send(self, job: SaveJob) -> None:
        """Store one copied save (the sender thread)."""
        new_blocks = self.guard.call("store", functools.partial(self._store, job))
        self.saved_blocks += new_blocks or 0

    def _store(self, job: SaveJob) -> int:
        num_tokens = len(job.tokens) - job.kv_start
        kv = layout.blocks_to_kv(job.blocks, self.spec.head_dim, job.offset, num_tokens)
        result = self.client.store(
            np.asarray(job.tokens, np.uint32),
            kv,
            model=self.spec,
            namespace=self.namespace,
            kv_start=job.kv_start,
        )
        return int(result.new_blocks)
