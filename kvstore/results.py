"""Typed results of the store's API, shared by the embedded store and the gRPC client."""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from kvstore.errors import InvalidInputError
from kvstore.model import ModelSpec
from kvstore.place import place_chunks

Array = np.ndarray[Any, Any]
DEFAULT_NAMESPACE = "default"


class LookupResult(NamedTuple):
    """Longest cached block-aligned prefix and where its blocks live."""

    num_tokens: int
    num_blocks: int
    memory_blocks: int


class StoreResult(NamedTuple):
    """Outcome of `store`: cached prefix length afterwards and what was written."""

    num_tokens: int
    new_blocks: int
    bytes_written: int


@dataclass(frozen=True)
class LoadedChunk:
    """One chunk of a load: its tokens' original positions and their KV.

    `kv` has shape (layers, 2, kv_heads, len(positions), head_dim) and may be a
    read-only view of the memory tier: copy before mutating.
    """

    block_index: int
    chunk_index: int
    positions: Array
    kv: Array
    tier: str
    nbytes: int


class LocalLoadStream:
    """The embedded store's `kvstore.api.LoadStream`: chunks of blocks read one at a time.

    Args:
        matched_tokens: prefix length the lookup promised.
        selected_tokens: tokens the budget selected.
        token_bytes: KV bytes of one token (for read amplification).
        block_tokens: tokens per block (a lost block ends the stream at its start).
        blocks: each block's verified chunks in order; None for a lost block, which ends it.
        on_finish: called once when the stream is exhausted (the store's counters).
        prefix_bytes: encoded bytes of all the matched blocks (for `read_fraction`).
        estimated_coverage: share of the estimated attention mass the plan selected.
    """

    def __init__(
        self,
        matched_tokens: int,
        selected_tokens: int,
        token_bytes: int,
        block_tokens: int,
        blocks: Iterator[list[LoadedChunk] | None],
        on_finish: Callable[[LocalLoadStream], None] = lambda stream: None,
        prefix_bytes: int = 0,
        estimated_coverage: float = 1.0,
    ) -> None:
        self.matched_tokens = matched_tokens
        self.num_tokens = matched_tokens
        self.selected_tokens = selected_tokens
        self.delivered_tokens = 0
        self.bytes_read = 0
        self.prefix_bytes = prefix_bytes
        self.estimated_coverage = estimated_coverage
        self._token_bytes = token_bytes
        self._block_tokens = block_tokens
        self._blocks = blocks
        self._blocks_read = 0
        self._pending: collections.deque[LoadedChunk] = collections.deque()
        self._on_finish: Callable[[LocalLoadStream], None] | None = on_finish

    @property
    def read_amplification(self) -> float:
        """Bytes read / bytes of the selected tokens (1.0 when nothing was selected)."""
        wanted = self.selected_tokens * self._token_bytes
        return self.bytes_read / wanted if wanted else 1.0

    @property
    def delivered_fraction(self) -> float:
        """Tokens delivered / tokens of the matched prefix (0.0 when nothing matched)."""
        return self.delivered_tokens / self.matched_tokens if self.matched_tokens else 0.0

    @property
    def read_fraction(self) -> float:
        """Bytes read / encoded bytes of the matched prefix (0.0 when nothing matched)."""
        return self.bytes_read / self.prefix_bytes if self.prefix_bytes else 0.0

    def __iter__(self) -> Iterator[LoadedChunk]:
        return self

    def __next__(self) -> LoadedChunk:
        while not self._pending:
            if self._on_finish is None:  # finished or closed
                raise StopIteration
            try:
                block = next(self._blocks)
            except StopIteration:
                self._finish(lost_block=False)
                raise
            if block is None:
                self._finish(lost_block=True)
                raise StopIteration
            self._blocks_read += 1
            self._pending.extend(block)
        chunk = self._pending.popleft()
        self.bytes_read += chunk.nbytes
        self.delivered_tokens += len(chunk.positions)
        return chunk

    def gather(self, model: ModelSpec) -> tuple[Array, Array]:
        """Read the rest of the stream into (positions (n,), kv (layers, 2, heads, n, dim))."""
        return gather_chunks(list(self), model)

    def close(self) -> None:
        """Stop reading; the chunks already read stay valid. Idempotent."""
        self._blocks = iter(())
        self._pending.clear()
        self._on_finish = None

    def __enter__(self) -> LocalLoadStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _finish(self, lost_block: bool) -> None:
        if lost_block:  # the prefix delivered ends where the lost block starts
            self.num_tokens = self._blocks_read * self._block_tokens
        on_finish, self._on_finish = self._on_finish, None
        if on_finish is not None:
            on_finish(self)


def gather_chunks(chunks: Iterable[LoadedChunk], model: ModelSpec) -> tuple[Array, Array]:
    """The chunks in stream order as (positions (n,), kv (layers, 2, heads, n, dim)): one new
    array, filled by two threads when it is large (kvstore/place.py)."""
    listed = list(chunks)
    kv = np.empty(model.kv_shape(sum(len(c.positions) for c in listed)), model.np_dtype)
    placed = place_chunks(listed, kv, at_positions=False)
    return placed.positions, kv


def validate_kv(toks: Array, kv: Array, scores: Array | None, model: ModelSpec) -> tuple[Array, Array | None]:
    """Check KV and scores against the tokens and the model; InvalidInputError names the field."""
    kv = np.asarray(kv)
    if kv.shape != model.kv_shape(len(toks)):
        raise InvalidInputError(
            f"kv must have shape (layers, 2, kv_heads, tokens, head_dim) = "
            f"{model.kv_shape(len(toks))} for {len(toks)} tokens of {model.name}, got {kv.shape}"
        )
    if kv.dtype != model.np_dtype:
        raise InvalidInputError(f"kv dtype must be {model.dtype} for {model.name}, got {kv.dtype}")
    if scores is not None:
        scores = np.asarray(scores, dtype=np.float32)
        if scores.shape != (len(toks),) or not np.all(np.isfinite(scores)):
            raise InvalidInputError(f"scores must be {len(toks)} finite floats, got shape {scores.shape}")
    return kv, scores


def check_layer(layer: object, num_layers: int) -> int:
    """`layer` as an int, or InvalidInputError naming it unless an integer in [0, num_layers)."""
    if isinstance(layer, bool) or not isinstance(layer, int | np.integer) or not 0 <= layer < num_layers:
        raise InvalidInputError(f"layer must be an integer in [0, {num_layers}), got {layer!r}")
    return int(layer)
