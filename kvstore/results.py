"""Typed results of the store's API, shared by the embedded store and the gRPC client."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from kvstore.errors import InvalidInputError
from kvstore.model import ModelSpec

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


class LoadStream:
    """Iterator of `LoadedChunk`, fastest tier first, block by block.

    Attributes (final once exhausted):
        matched_tokens: prefix length the lookup promised.
        num_tokens: prefix length actually delivered (shorter if a block was corrupt).
        selected_tokens: tokens the budget selected.
        delivered_tokens: tokens in the delivered chunks (>= selected within full chunks).
        bytes_read: encoded bytes read from all tiers.
    """

    def __init__(self, matched_tokens: int, selected_tokens: int, token_bytes: int) -> None:
        self.matched_tokens = matched_tokens
        self.num_tokens = matched_tokens
        self.selected_tokens = selected_tokens
        self.delivered_tokens = 0
        self.bytes_read = 0
        self._token_bytes = token_bytes
        self._source: Iterator[LoadedChunk] = iter(())

    @property
    def read_amplification(self) -> float:
        """Bytes read / bytes of the selected tokens (1.0 when nothing was selected)."""
        wanted = self.selected_tokens * self._token_bytes
        return self.bytes_read / wanted if wanted else 1.0

    def __iter__(self) -> Iterator[LoadedChunk]:
        return self

    def __next__(self) -> LoadedChunk:
        return next(self._source)

    def gather(self, model: ModelSpec) -> tuple[Array, Array]:
        """Read the rest of the stream into (positions (n,), kv (layers, 2, heads, n, dim))."""
        return gather_chunks(list(self), model)

    def __enter__(self) -> LoadStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self._source = iter(())


def gather_chunks(chunks: Sequence[LoadedChunk], model: ModelSpec) -> tuple[Array, Array]:
    """Concatenate chunks into (positions, kv), in stream order."""
    if not chunks:
        return np.zeros(0, np.int64), np.zeros(model.kv_shape(0), model.np_dtype)
    positions = np.concatenate([c.positions for c in chunks])
    return positions, np.concatenate([c.kv for c in chunks], axis=3)


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
