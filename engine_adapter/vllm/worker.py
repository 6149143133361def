"""Worker side of the vLLM connector: moves KV between the sidecar and vLLM's paged cache.

Loads run before the forward pass (`start_load`), saves after it (`save`); both
are synchronous, because on CPU the forward pass itself is: when `save` runs,
every layer's KV of the step is in the cache. A load that fails or comes back
short marks the affected vLLM blocks as failed, and vLLM recomputes them.
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
from kvstore.api import PrefixStore
from kvstore.errors import InvalidInputError
from kvstore.model import ModelSpec


class LoadOutcome(NamedTuple):
    """What one load wrote: the tokens placed and the vLLM blocks that must be recomputed."""

    written_tokens: int
    failed_blocks: frozenset[int]


def layer_order(names: list[str]) -> list[str]:
    """Layer names sorted by the layer number they contain ("model.layers.12.self_attn.attn")."""

    def number(name: str) -> int:
        found = re.findall(r"\.(\d+)\.", f".{name}.")
        if len(found) != 1:
            raise InvalidInputError(f"cannot tell the layer number of KV cache layer {name!r}")
        return int(found[0])

    return sorted(names, key=number)


class WorkerSide:
    """The connector's worker half. Single-threaded (vLLM's model runner thread).

    Args:
        client: the store: a `KVClient`, or any `PrefixStore` (an embedded one in tests).
        spec: the model's identity and KV shape.
        namespace: tenant of every call.
        block_size: tokens per vLLM cache block.
        guard: the circuit breaker around sidecar calls.
    """

    def __init__(
        self, client: PrefixStore, spec: ModelSpec, namespace: str, block_size: int, guard: SidecarGuard
    ):
        self.client = client
        self.spec = spec
        self.namespace = namespace
        self.block_size = block_size
        self.guard = guard
        self.layers: list[torch.Tensor] = []
        self._failed_blocks: set[int] = set()
        self._step_failed = False

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
        """Store every save of the step; the number of new blocks the sidecar wrote.

        Nothing is stored in a step where a load failed: tokens computed in it
        attended to blocks that were never filled, so their KV is wrong (vLLM
        recomputes them, and a later request stores the blocks).
        """
        if self._step_failed:
            return 0
        new_blocks = 0
        for op in ops:
            result = self.guard.call("store", functools.partial(self._store, op))
            new_blocks += result or 0
        return new_blocks

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

    def _store(self, op: SaveOp) -> int:
        positions = np.arange(op.kv_start, len(op.tokens))
        slots = layout.slots_of(positions, op.block_table, self.block_size)
        kv = layout.to_numpy(layout.gather(self.layers, slots, self.spec.head_dim))
        result = self.client.store(
            np.asarray(op.tokens, np.uint32),
            kv,
            model=self.spec,
            namespace=self.namespace,
            kv_start=op.kv_start,
        )
        return int(result.new_blocks)
