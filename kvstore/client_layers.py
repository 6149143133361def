"""The sidecar client's `LayeredLoad`, for now an empty one.

Reading a prefix layer by layer through the sidecar needs RPCs that do not exist yet
(a later step of issue 9: a summary read and a per-layer chunk read on the Load
service). Until then `KVClient.open_layers` answers `matched_tokens == 0`, which the
contract allows ("not cached in the layered layout"): a caller falls back to `load`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvstore.api import LayerSlice
from kvstore.errors import InvalidInputError
from kvstore.model import ModelSpec
from kvstore.results import Array


class EmptyLayeredLoad:
    """A `kvstore.api.LayeredLoad` that matched nothing: every read is out of range.

    Args:
        model: the model the load was opened for (its layer count).
        chunk_tokens: tokens per per-layer chunk to report (the store's setting if known).
    """

    def __init__(self, model: ModelSpec, chunk_tokens: int = 8) -> None:
        self.matched_tokens = 0
        self.chunk_tokens = chunk_tokens
        self.num_layers = model.num_layers
        self.prefix_bytes = self.summary_bytes = self.bytes_read = self.delivered_tokens = 0
        self._model = model

    @property
    def delivered_fraction(self) -> float:
        """Always 0.0: nothing matched."""
        return 0.0

    @property
    def read_fraction(self) -> float:
        """Always 0.0: nothing matched."""
        return 0.0

    def key_summary(self, layer: int) -> Array:
        """An empty (kv_heads, 0, head_dim) float32 array; InvalidInputError for a bad layer."""
        self._check_layer(layer)
        return np.zeros((self._model.num_kv_heads, 0, self._model.head_dim), np.float32)

    def read_layer(self, layer: int, chunks: Sequence[int]) -> LayerSlice:
        """Nothing to read: InvalidInputError for a bad layer or any chunk index."""
        self._check_layer(layer)
        if len(chunks):
            raise InvalidInputError(f"chunks must be integers in [0, 0), got {next(iter(chunks))!r}")
        shape = (2, self._model.num_kv_heads, 0, self._model.head_dim)
        return LayerSlice(np.zeros(0, np.int64), np.zeros(shape, self._model.np_dtype))

    def close(self) -> None:
        """Nothing to release."""

    def __enter__(self) -> EmptyLayeredLoad:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_layer(self, layer: int) -> None:
        if (
            isinstance(layer, bool)
            or not isinstance(layer, int | np.integer)
            or not 0 <= layer < self.num_layers
        ):
            raise InvalidInputError(f"layer must be an integer in [0, {self.num_layers}), got {layer!r}")
