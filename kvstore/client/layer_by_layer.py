"""The sidecar client's `LayeredLoad`s: one LoadLayers stream, or an empty load.

`RemoteLayeredLoad` is the client's side of one LoadLayers stream (the server's is
kvstore/server/layers.py). The stream is a conversation: requests go through a
queue that gRPC drains on its own thread, and every request gets one answer, read
in the caller's thread. Inputs are checked here before anything is sent, so a bad
layer or chunk index costs no round trip. `EmptyLayeredLoad` answers for a server
that predates LoadLayers (matched 0: the caller falls back to `load`).
"""

from __future__ import annotations

import queue
from collections.abc import Callable, Sequence
from typing import Any

import grpc
import numpy as np

from importance.lowbit import LowBitKeys, dequantize, unpack_codes
from kvstore._generated.kvsieve.v1 import kvsieve_pb2 as pb
from kvstore.api import LayerSlice
from kvstore.client.stream import domain_error
from kvstore.errors import InvalidInputError, StorageUnavailableError
from kvstore.model import ModelSpec
from kvstore.values import check_layer

Array = np.ndarray[Any, Any]
_END = None  # what ends the request iterator (and so the stream, from our side)


class RemoteLayeredLoad:
    """`kvstore.api.LayeredLoad` of a sidecar. One caller thread at a time; close it when done."""

    def __init__(self, start: Callable[[Any], Any], open_request: pb.LayersOpen, model: ModelSpec) -> None:
        """Open the stream; `start(request_iterator)` makes the call (with metadata and deadline)."""
        self._model = model
        self._requests: queue.SimpleQueue[pb.LayersRequest | None] = queue.SimpleQueue()
        self._requests.put(pb.LayersRequest(open=open_request))
        self._responses = start(iter(self._requests.get, _END))
        self._closed = False
        self._summaries: dict[int, Array] = {}
        header = self._receive("header").header
        self.matched_tokens = int(header.matched_tokens)
        self.chunk_tokens = int(header.chunk_tokens)
        self.num_layers = int(header.num_layers) or model.num_layers
        self.prefix_bytes = int(header.prefix_bytes)
        self.summary_bytes = int(header.summary_bytes)
        self.bytes_read = 0
        self.delivered_tokens = 0
        self._layers_read = 0
        if not self.matched_tokens:
            self.close()

    @property
    def delivered_fraction(self) -> float:
        """Delivered tokens / (matched tokens x layers read); 0.0 before any layer."""
        seen = self.matched_tokens * self._layers_read
        return self.delivered_tokens / seen if seen else 0.0

    @property
    def read_fraction(self) -> float:
        """Bytes read / the matched blocks' encoded bytes."""
        return self.bytes_read / self.prefix_bytes if self.prefix_bytes else 0.0

    def key_summary(self, layer: int) -> Array:
        """Approximate keys of `layer` (float32 (kv_heads, matched, head_dim)), fetched once."""
        self._check_layer(layer)
        if layer not in self._summaries:
            answer = self._ask(pb.LayerRead(layer=layer, summary=True), "summary")
            self._summaries[layer] = dequantize(summary_from_pb(answer.summary))
        return self._summaries[layer]

    def read_layer(self, layer: int, chunks: Sequence[int]) -> LayerSlice:
        """Chunks `chunks` of `layer`, as a `LayerSlice` (arrays owned by the caller)."""
        self._check_layer(layer)
        wanted = np.asarray(list(chunks), dtype=np.int64)
        count = -(-self.matched_tokens // self.chunk_tokens) if self.chunk_tokens else 0
        if len(wanted) and (wanted.min() < 0 or wanted.max() >= count or np.any(np.diff(wanted) <= 0)):
            raise InvalidInputError(
                f"chunks must be ascending, distinct indices in [0, {count}), got {chunks!r}"
            )
        answer = self._ask(pb.LayerRead(layer=layer, chunks_u32le=wanted.astype("<u4").tobytes()), "data")
        positions = np.frombuffer(answer.data.positions_u32le, "<u4").astype(np.int64)
        m = self._model
        kv = np.frombuffer(answer.data.kv, m.np_dtype).reshape(2, m.num_kv_heads, len(positions), m.head_dim)
        self._layers_read += 1
        return LayerSlice(positions, kv)

    def close(self) -> None:
        """End the stream (the server releases its pin). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._requests.put(_END)
        cancel = getattr(self._responses, "cancel", None)
        if cancel is not None:
            cancel()

    def __enter__(self) -> RemoteLayeredLoad:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_layer(self, layer: int) -> None:
        if self._closed:
            raise InvalidInputError("this layered load is closed (or matched nothing)")
        check_layer(layer, self.num_layers)

    def _ask(self, read: pb.LayerRead, part: str) -> pb.LayersResponse:
        self._requests.put(pb.LayersRequest(read=read))
        answer = self._receive(part)
        self.bytes_read = int(answer.bytes_read)
        self.delivered_tokens = int(answer.delivered_tokens)
        return answer

    def _receive(self, part: str) -> pb.LayersResponse:
        try:
            answer = next(self._responses)
        except grpc.RpcError as exc:
            self._closed = True
            raise domain_error(exc) from exc
        except StopIteration:
            self._closed = True
            raise StorageUnavailableError("the sidecar ended the LoadLayers stream early") from None
        if answer.WhichOneof("part") != part:
            self.close()
            raise StorageUnavailableError(f"LoadLayers: expected a {part}, got {answer.WhichOneof('part')}")
        return answer


def summary_from_pb(summary: pb.LayerSummary) -> LowBitKeys:
    """Inverse of `kvstore.server.layers.summary_to_pb`."""
    heads, n, dim = summary.kv_heads, summary.num_tokens, summary.head_dim
    groups = -(-n // max(1, summary.group_tokens))
    codes = unpack_codes(summary.codes, summary.bits, (heads, n, dim))
    low = np.frombuffer(summary.low_f16, "<f2").reshape(heads, groups, dim).astype(np.float16)
    step = np.frombuffer(summary.step_f16, "<f2").reshape(heads, groups, dim).astype(np.float16)
    return LowBitKeys(codes, low, step, summary.bits, summary.group_tokens)


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
        check_layer(layer, self.num_layers)
