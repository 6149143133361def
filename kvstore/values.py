"""The typed values of the store's API: what `lookup`, `store` and `load` return, and the
checks every implementation runs on what it is given (kvstore/api.py is the contract)."""

from __future__ import annotations

from collections.abc import Sequence
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


def check_chunks(chunks: Sequence[int] | Array, total: int) -> Array:
    """`chunks` sorted, as an int64 array, or InvalidInputError unless distinct integers in [0, total)
    (an integer array is checked in a few vector operations: a layer-by-layer load passes one per
    layer, thousands of chunks at 16k tokens)."""
    if isinstance(chunks, np.ndarray) and chunks.dtype.kind in "iu":
        values = np.sort(chunks.astype(np.int64).reshape(-1))
        bad = values[(values < 0) | (values >= total)]
        if len(bad):
            raise InvalidInputError(f"chunks must be integers in [0, {total}), got {int(bad[0])}")
        if len(values) > 1 and not np.all(np.diff(values)):
            raise InvalidInputError(f"chunks must not repeat an index, got {values.tolist()}")
        return values
    items = list(chunks)
    for c in items:
        if isinstance(c, bool) or not isinstance(c, int | np.integer) or not 0 <= c < total:
            raise InvalidInputError(f"chunks must be integers in [0, {total}), got {c!r}")
    if len(set(items)) != len(items):
        raise InvalidInputError(f"chunks must not repeat an index, got {sorted(items)}")
    return np.asarray(sorted(int(c) for c in items), dtype=np.int64)
