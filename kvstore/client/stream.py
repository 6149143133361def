"""RemoteLoadStream: the client's side of one Load call (kvstore.api.LoadStream).

Chunks arrive inline or as descriptors into the client's shared-memory arena
(kvstore/client/arenas.py); the stream hands the arena back when it closes.
"""

from __future__ import annotations

import collections
import dataclasses
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import numpy as np

from kvstore._generated.kvsieve.v1 import kvsieve_pb2 as pb
from kvstore.client.arenas import ArenaPool, ClientArena, gather_by_position, increasing
from kvstore.errors import KVSieveError
from kvstore.load.stream import gather_chunks
from kvstore.model import ModelSpec
from kvstore.rpc import shm
from kvstore.rpc.status import error_for
from kvstore.values import LoadedChunk

Array = np.ndarray[Any, Any]


def domain_error(exc: grpc.RpcError) -> KVSieveError:
    """The kvsieve error a failed RPC's status stands for (kvstore/rpc/status.py)."""
    return error_for(exc.code(), exc.details() or "")


class RemoteLoadStream:
    """The client's `kvstore.api.LoadStream`: `LoadedChunk`s of a Load call.

    Use it as a context manager (or call `close`): closing hands the shared-memory
    arena back for reuse, so chunk views must not be used after it.
    """

    def __init__(
        self, responses: Any, model: ModelSpec, arena: ClientArena | None, pool: ArenaPool,
        on_packed_tokens: Callable[[], None] = lambda: None,
    ) -> None:  # fmt: skip
        self._responses = responses
        self._on_packed_tokens = on_packed_tokens
        self._model = model
        self._arena = arena
        self._pool = pool
        self._finalizer = (
            None if arena is None else weakref.finalize(self, pool.orphan, arena.arena_id, arena.namespace)
        )
        self._finished = False
        self._pending: collections.deque[LoadedChunk] = collections.deque()
        self._dense: Array | None = None
        self._dense_slots = 0  # tokens delivered through the arena, in slot order from 0
        self._by_position = False  # the server put each token at the slot of its position
        self._gathering = False  # gather reads the arena itself: chunks need no KV of their own
        self.matched_tokens = self.num_tokens = self.selected_tokens = 0
        self.delivered_tokens = self.bytes_read = 0
        self.read_amplification = 1.0
        self.delivered_fraction = self.read_fraction = 0.0
        self.estimated_coverage = 1.0
        self._started = False

    def __iter__(self) -> Iterator[LoadedChunk]:
        return self

    def __next__(self) -> LoadedChunk:
        if self._pending:
            return self._pending.popleft()
        try:
            while True:
                response = next(self._responses)
                part = response.WhichOneof("part")
                if part == "batch" and len(response.batch.chunks):
                    self._pending.extend(self._chunk(c) for c in response.batch.chunks)
                    return self._pending.popleft()
                if part == "chunk":
                    return self._chunk(response.chunk)
                if part == "header":
                    self._header(response.header)
                elif part == "trailer":
                    self._trailer(response.trailer)
        except grpc.RpcError as exc:
            self._drop_arena()
            raise domain_error(exc) from None
        except StopIteration:
            self._finished = True
            raise

    def gather(self, model: ModelSpec) -> tuple[Array, Array]:
        """Read the rest of the stream into (positions (n,), kv (layers, 2, heads, n, dim)).

        Through shared memory the KV is a read-only view of the arena, copied by
        nobody (valid until `close`); otherwise the chunks are concatenated.
        """
        self._gathering = True
        try:
            chunks = list(self)
        finally:
            self._gathering = False
        slots = sum(len(c.positions) for c in chunks)
        if self._dense is not None and chunks and self._dense_slots == slots and self._by_position:
            return gather_by_position(self._dense, np.concatenate([c.positions for c in chunks]))
        if self._dense is not None and chunks and self._dense_slots == slots:
            positions = np.concatenate([c.positions for c in chunks])
            return positions, self._dense[:, :, :, :slots]
        if self._dense is not None and self._by_position:  # some chunks came inline: fill in the rest
            chunks = [c if c.kv.shape[3] == len(c.positions) else self._from_arena(c) for c in chunks]
        return gather_chunks(chunks, model)

    def _from_arena(self, chunk: LoadedChunk) -> LoadedChunk:
        """A chunk written by position, read back from the arena (its slots are its positions)."""
        assert self._dense is not None
        return dataclasses.replace(chunk, kv=np.take(self._dense, chunk.positions, axis=3))

    def close(self) -> None:
        """End the stream (cancelling it if unfinished) and hand the arena back. Idempotent."""
        if not self._finished:
            self._responses.cancel()
            self._finished = True
        if self._arena is not None:
            if self._finalizer is not None:
                self._finalizer.detach()
            self._pool.give(self._arena)
            self._arena = None
            self._dense = None

    @property
    def arena_view(self) -> Array | None:
        """The whole shared-memory arena as a KV array while this stream uses one, else None."""
        return self._dense

    def __enter__(self) -> RemoteLoadStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _header(self, header: pb.LoadHeader) -> None:
        self.matched_tokens = self.num_tokens = header.matched_tokens
        self.selected_tokens = header.selected_tokens
        if header.packed_tokens:
            self._on_packed_tokens()
        self._by_position = header.shm_by_position
        if self._arena is not None:
            if header.shm:
                self._dense = shm.dense_view(self._arena.buf, self._model)
                self._dense.flags.writeable = False  # the mapping may be writable (Stores): views are not
            else:
                self._drop_arena()

    def _trailer(self, trailer: pb.LoadTrailer) -> None:
        self.num_tokens = trailer.num_tokens
        self.bytes_read = trailer.bytes_read
        self.read_amplification = trailer.read_amplification
        self.delivered_tokens = trailer.delivered_tokens
        self.delivered_fraction = trailer.delivered_fraction
        self.read_fraction = trailer.read_fraction
        self.estimated_coverage = trailer.estimated_coverage

    def _chunk(self, chunk: pb.Chunk) -> LoadedChunk:
        n = len(chunk.positions_u32le) // 4 or len(chunk.positions)
        shape = self._model.kv_shape(n)
        if chunk.positions_u32le:
            positions = np.frombuffer(chunk.positions_u32le, "<u4").astype(np.int64)
        else:
            positions = np.fromiter(chunk.positions, np.int64, count=n)
        if chunk.HasField("shm") and self._dense is not None:
            kv = self._shm_kv(chunk.shm.slot, positions)
            self._dense_slots += chunk.shm.num_tokens
            nbytes = n * self._model.token_bytes
        else:
            kv = np.frombuffer(chunk.data, self._model.np_dtype).reshape(shape)
            nbytes = len(chunk.data)
        return LoadedChunk(chunk.block_index, chunk.chunk_index, positions, kv, chunk.tier, nbytes)

    def _shm_kv(self, slot: int, positions: Array) -> Array:
        """A chunk's KV in the arena: a view of its slots, or (by position, out of order) a copy."""
        assert self._dense is not None
        n = len(positions)
        if self._gathering and self._by_position:  # gather takes the tokens from the arena in one pass
            return self._dense[:, :, :, slot:slot]
        if not self._by_position or (n and positions[-1] - positions[0] == n - 1 and increasing(positions)):
            return self._dense[:, :, :, slot : slot + n]
        return self._dense[:, :, :, positions]

    def _drop_arena(self) -> None:
        if self._arena is not None:
            if self._finalizer is not None:
                self._finalizer.detach()
            self._pool.discard(self._arena)  # unmaps once the caller drops its views
            self._arena = None
            self._dense = None
