"""`ArrayLayers`: a `LayeredLoad` over a prefix's KV held in this process.

A genuine implementation of the `kvstore.api.LayeredLoad` contract (not a test
double): the quality benchmark and the tests run the engine's layer-by-layer
path on prefixes computed in process (`Engine.analyze`), with the same summaries
(`lowbit2` per 256-token block, importance/lowbit.py), the same chunking and the
same byte accounting as the store's layered layout. Each layer's KV is
checksummed when the load is made and verified on every read, as the store
verifies its records: bytes changed under the load raise `ChecksumError`.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from importance.lowbit import dequantize, packed_bytes, quantize
from kvstore.api import LayerSlice
from kvstore.errors import ChecksumError, InvalidInputError
from kvstore.values import check_layer

Array = np.ndarray[Any, Any]
SUMMARY_BITS = 2
BLOCK_TOKENS = 256
CHUNK_TOKENS = 8


class ArrayLayers:
    """A layer-by-layer load of `kv` (layers, 2, kv_heads, n, head_dim) fp16, prompt order.

    `kv` is held, not copied (it is only read). `bytes_read` counts what the store
    would read: a layer's summary on its first `key_summary`, then the chosen chunks'
    K+V bytes.
    """

    def __init__(self, kv: Array, chunk_tokens: int = CHUNK_TOKENS, block_tokens: int = BLOCK_TOKENS) -> None:
        if kv.ndim != 5 or kv.shape[1] != 2 or kv.dtype.name not in ("float16", "bfloat16"):
            raise InvalidInputError(
                f"kv must be fp16 or bf16 (layers, 2, heads, tokens, dim), got {kv.dtype} {kv.shape}"
            )
        self.kv = kv
        self.num_layers, _, self._heads, self.matched_tokens, self._dim = (int(x) for x in kv.shape)
        self.chunk_tokens, self._block = int(chunk_tokens), int(block_tokens)
        self._token_bytes = 2 * self._heads * self._dim * kv.itemsize  # K+V of one token in one layer
        starts = range(0, self.matched_tokens, self._block)
        per_layer = sum(
            packed_bytes(
                min(self._block, self.matched_tokens - s), self._heads, self._dim, SUMMARY_BITS, self._block
            )
            for s in starts
        )
        self._summary_layer_bytes = per_layer
        self.summary_bytes = per_layer * self.num_layers
        self.prefix_bytes = self.matched_tokens * self._token_bytes * self.num_layers + self.summary_bytes
        self.bytes_read = 0
        self.delivered_tokens = 0
        self._summaries: dict[int, Array] = {}
        self._layers_read: set[int] = set()
        self._crc = [zlib.crc32(np.ascontiguousarray(layer).data) for layer in kv]
        self.closed = False

    @property
    def delivered_fraction(self) -> float:
        """Delivered tokens / (matched tokens x layers read); 0.0 before any layer."""
        layers = len(self._layers_read)
        return (
            self.delivered_tokens / (self.matched_tokens * layers) if layers and self.matched_tokens else 0.0
        )

    @property
    def read_fraction(self) -> float:
        """Bytes read / `prefix_bytes` (0.0 if nothing matched)."""
        return self.bytes_read / self.prefix_bytes if self.prefix_bytes else 0.0

    def key_summary(self, layer: int) -> Array:
        """Keys of `layer` decoded from their 2-bit summary, float32 (kv_heads, n, head_dim)."""
        self._check_layer(layer)
        if layer not in self._summaries:
            self._verify(layer)
            keys = self.kv[layer, 0].astype(np.float32)
            self._summaries[layer] = dequantize(quantize(keys, SUMMARY_BITS, self._block))
            self.bytes_read += self._summary_layer_bytes
        return self._summaries[layer]

    def read_layer(self, layer: int, chunks: Sequence[int]) -> LayerSlice:
        """The chosen chunks of `layer`: positions ascending, KV (2, heads, tokens, dim) fp16."""
        self._check_layer(layer)
        count = -(-self.matched_tokens // self.chunk_tokens)
        wanted = np.asarray(list(chunks), dtype=np.int64)
        if (
            wanted.ndim != 1
            or len(np.unique(wanted)) != len(wanted)
            or ((wanted < 0) | (wanted >= count)).any()
        ):
            raise InvalidInputError(f"chunks must be distinct indices in [0, {count}), got {list(chunks)}")
        self._verify(layer)
        spans = (wanted[:, None] * self.chunk_tokens + np.arange(self.chunk_tokens)[None, :]).reshape(-1)
        positions = np.sort(spans[spans < self.matched_tokens])
        part = self.kv[layer][:, :, positions]
        self.bytes_read += len(positions) * self._token_bytes
        self.delivered_tokens += len(positions)
        self._layers_read.add(layer)
        return LayerSlice(positions, part)

    def close(self) -> None:
        """Drop the decoded summaries. Idempotent."""
        self._summaries.clear()
        self.closed = True

    def __enter__(self) -> ArrayLayers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_layer(self, layer: int) -> None:
        if self.closed:
            raise InvalidInputError("the layered load is closed")
        check_layer(layer, self.num_layers)

    def _verify(self, layer: int) -> None:
        if zlib.crc32(np.ascontiguousarray(self.kv[layer]).data) != self._crc[layer]:
            raise ChecksumError(f"layer {layer} of the prefix's KV changed after the load was made")
