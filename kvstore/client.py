"""KVClient: the `PrefixStore` of a sidecar, over gRPC.

It implements `kvstore.api.PrefixStore` (the contract is documented there) like the
embedded `TieredStore`, so callers switch between the two by configuration. It
imports neither the store nor its tiers (no lmdb, no redis). Co-located with the
server, loads arrive through shared memory (kvstore/client_arenas.py).
"""

from __future__ import annotations

import collections
import contextlib
import os
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import numpy as np

from kvstore import shm
from kvstore._generated.kvsieve.v1 import kvsieve_pb2 as pb
from kvstore._generated.kvsieve.v1 import kvsieve_pb2_grpc as pb_grpc
from kvstore.api import Lease, StoreInfo, Tokens
from kvstore.budget import Budget, budget_to_fields, resolve_budget
from kvstore.client_arenas import ArenaPool, ClientArena, gather_by_position, increasing
from kvstore.errors import KVSieveError
from kvstore.errors import RpcFailedError as RpcFailedError  # re-export (old home)
from kvstore.keys import as_token_array, validate_namespace
from kvstore.model import ModelSpec
from kvstore.results import (
    DEFAULT_NAMESPACE,
    LoadedChunk,
    LookupResult,
    StoreResult,
    gather_chunks,
    validate_kv,
)
from kvstore.server.status import error_for
from kvstore.stats import StoreStats
from kvstore.transport import channel_options, is_loopback
from kvstore.wire import ctx_to_pb, kv_bytes, stats_from_pb

Array = np.ndarray[Any, Any]


class KVClient:
    """`PrefixStore` of a `kvsieve serve` sidecar. Thread-safe (one channel, many calls).

    Args:
        target: "HOST:PORT" or "unix:PATH" of a `kvsieve serve`.
        token: bearer token, if the server requires one.
        root_certificates: PEM CA bundle to use TLS.
        use_shm: "auto" (shared memory when the server is on this host), True or False.
        timeout_s: default deadline of every call.
    """

    def __init__(
        self,
        target: str,
        *,
        token: str | None = None,
        root_certificates: bytes | None = None,
        use_shm: bool | str = "auto",
        timeout_s: float = 60.0,
        max_message_bytes: int = 64 << 20,
    ) -> None:
        options = channel_options(max_message_bytes)
        if root_certificates is not None:
            credentials = grpc.ssl_channel_credentials(root_certificates)
            self._channel = grpc.secure_channel(target, credentials, options=options)
        else:
            self._channel = grpc.insecure_channel(target, options=options)
        self._stub = pb_grpc.KVCacheStub(self._channel)
        self._metadata = [("authorization", f"Bearer {token}")] if token else []
        self._timeout = timeout_s
        self._slice_bytes = max(1 << 20, max_message_bytes - (1 << 20))
        self._shm = shm.available() and (is_loopback(target) if use_shm == "auto" else bool(use_shm))
        self._arenas = ArenaPool(self._create_arena)
        self._packed_tokens = False  # the server reads packed tokens (said in a reply; see the proto)

    @property
    def info(self) -> StoreInfo:
        """Unknown block and chunk size: the sidecar drops a trailing partial block itself."""
        return StoreInfo(None, None)

    def lookup(self, tokens: Tokens, *, model: ModelSpec, namespace: str = DEFAULT_NAMESPACE) -> LookupResult:
        request = pb.LookupRequest(ctx=_ctx(model, namespace))
        self._set_tokens(request, _tokens(tokens))
        reply = self._call(self._stub.Lookup, request)
        self._packed_tokens |= reply.packed_tokens
        return LookupResult(reply.num_tokens, reply.num_blocks, reply.memory_blocks)

    def store(
        self,
        tokens: Tokens,
        kv: Array,
        *,
        model: ModelSpec,
        namespace: str = DEFAULT_NAMESPACE,
        scores: Array | None = None,
        kv_start: int = 0,
    ) -> StoreResult:
        # KV travels in slices below the message limit.
        toks = _tokens(tokens)
        kv, scores = validate_kv(toks[kv_start:], kv, scores, model)  # fail before sending
        header = pb.StoreHeader(ctx=_ctx(model, namespace), tokens=toks, kv_start=kv_start)
        if scores is not None:
            header.scores.extend(scores.tolist())
        step = max(1, self._slice_bytes // max(1, model.token_bytes))

        def requests() -> Iterator[pb.StoreRequest]:
            yield pb.StoreRequest(header=header)
            for start in range(0, kv.shape[3], step):
                part = kv[:, :, :, start : start + step]
                yield pb.StoreRequest(
                    slice=pb.KVSlice(
                        start_token=kv_start + start, num_tokens=part.shape[3], data=kv_bytes(part)
                    )
                )

        reply = self._call(self._stub.Store, requests())
        return StoreResult(reply.num_tokens, reply.new_blocks, reply.bytes_written)

    def load(
        self,
        tokens: Tokens,
        *,
        model: ModelSpec,
        namespace: str = DEFAULT_NAMESPACE,
        budget: Budget = 1.0,
        budget_tokens: int | None = None,
        coverage: float | None = None,
    ) -> RemoteLoadStream:
        toks = _tokens(tokens)
        fields = budget_to_fields(resolve_budget(budget, budget_tokens, coverage))
        request = pb.LoadRequest(ctx=_ctx(model, namespace), packed_positions=True, **fields)
        self._set_tokens(request, toks)
        self._release_orphans()
        arena = None
        if self._shm and len(toks):
            arena = self._arenas.take(namespace, len(toks) * model.token_bytes)
        if arena is not None:
            request.arena_id = arena.arena_id
            request.shm_by_position = True
        try:
            responses = self._stub.Load(request, timeout=self._timeout, metadata=self._metadata)
            return RemoteLoadStream(responses, model, arena, self._arenas, self._learn_packed)
        except BaseException:
            if arena is not None:
                self._arenas.discard(arena)
            raise

    def load_arrays(self, tokens: Tokens, **kwargs: Any) -> tuple[int, Array, Array]:
        """`load`, gathered: (prefix tokens covered, positions, kv); copies that outlive the stream."""
        with self.load(tokens, **kwargs) as stream:
            positions, kv = stream.gather(kwargs["model"])
            return stream.num_tokens, positions, np.array(kv)

    def report_scores(
        self, tokens: Tokens, scores: Array, *, model: ModelSpec, namespace: str = DEFAULT_NAMESPACE
    ) -> int:
        request = pb.ReportScoresRequest(
            ctx=_ctx(model, namespace),
            tokens=_tokens(tokens),
            scores=np.asarray(scores, np.float32).tolist(),
        )
        return int(self._call(self._stub.ReportScores, request).blocks_updated)

    def pin(
        self, tokens: Tokens, *, model: ModelSpec, namespace: str = DEFAULT_NAMESPACE, ttl_s: float = 60.0
    ) -> Lease:
        request = pb.PinRequest(ctx=_ctx(model, namespace), tokens=_tokens(tokens), ttl_s=ttl_s)
        reply = self._call(self._stub.Pin, request)
        # The deadline is counted from receipt: never later than the server's own.
        return Lease(reply.lease_id, reply.num_blocks, reply.ttl_s, time.monotonic() + reply.ttl_s)

    def unpin(self, lease_id: str) -> None:
        self._call(self._stub.Unpin, pb.UnpinRequest(lease_id=lease_id))

    def stats(self) -> StoreStats:
        return stats_from_pb(self._call(self._stub.Stats, pb.StatsRequest()))

    def close(self) -> None:
        for arena in self._arenas.drain():
            self._arenas.orphan(arena.arena_id, arena.namespace)
        self._release_orphans()
        self._channel.close()

    def _create_arena(self, namespace: str, nbytes: int) -> ClientArena | None:
        """Ask the server for an arena and map it; None (load inline) if either fails."""
        request = pb.CreateArenaRequest(namespace=namespace, nbytes=nbytes, client_pid=os.getpid())
        try:
            reply = self._stub.CreateArena(request, timeout=self._timeout, metadata=self._metadata)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:  # an older server
                self._shm = False
            return None  # over a limit, or out of memory there: this load goes inline
        ref = shm.ArenaRef(reply.server_pid, reply.fd, reply.nbytes, reply.inode)
        try:
            buf = shm.map_arena(ref)
        except OSError:  # another host, pid namespace or uid: inline from now on
            self._shm = False
            self._release_segment(reply.arena_id, namespace)
            return None
        return ClientArena(reply.arena_id, namespace, buf)

    def _set_tokens(self, request: Any, toks: Array) -> None:
        """Tokens packed (one bytes field); repeated too until the server said it reads them."""
        request.tokens_u32le = toks.astype("<u4", copy=False).tobytes()
        if not self._packed_tokens:  # an older server reads only the repeated field
            request.tokens.extend(toks.tolist())

    def _learn_packed(self) -> None:
        self._packed_tokens = True

    def _release_orphans(self) -> None:
        for arena_id, namespace in self._arenas.take_orphans():
            self._release_segment(arena_id, namespace)

    def _release_segment(self, arena_id: str, namespace: str) -> None:
        request = pb.ReleaseSegmentRequest(arena_id=arena_id, namespace=namespace)
        with contextlib.suppress(grpc.RpcError):
            self._stub.ReleaseSegment(request, timeout=5, metadata=self._metadata)

    def __enter__(self) -> KVClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: Any, request: Any) -> Any:
        try:
            return method(request, timeout=self._timeout, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise _domain_error(exc) from None


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
            raise _domain_error(exc) from None
        except StopIteration:
            self._finished = True
            raise

    def gather(self, model: ModelSpec) -> tuple[Array, Array]:
        """Read the rest of the stream into (positions (n,), kv (layers, 2, heads, n, dim)).

        Through shared memory the KV is a read-only view of the arena, copied by
        nobody (valid until `close`); otherwise the chunks are concatenated.
        """
        self._gathering = True  # an error ends the stream: no chunk is read with it left set
        chunks = list(self)
        self._gathering = False
        slots = sum(len(c.positions) for c in chunks)
        if self._dense is not None and chunks and self._dense_slots == slots and self._by_position:
            return gather_by_position(self._dense, np.concatenate([c.positions for c in chunks]))
        if self._dense is not None and chunks and self._dense_slots == slots:
            positions = np.concatenate([c.positions for c in chunks])
            return positions, self._dense[:, :, :, :slots]
        return gather_chunks(chunks, model)

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
                self._dense = shm.dense_view(self._arena.buf, self._model)  # read-only mapping
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
        if not self._by_position or (n and positions[-1] - positions[0] == n - 1 and increasing(positions)):
            return self._dense[:, :, :, slot : slot + n]
        if self._gathering:  # gather takes the tokens from the arena in one pass
            return self._dense[:, :, :, slot:slot]
        return self._dense[:, :, :, positions]

    def _drop_arena(self) -> None:
        if self._arena is not None:
            if self._finalizer is not None:
                self._finalizer.detach()
            self._pool.discard(self._arena)  # unmaps once the caller drops its views
            self._arena = None
            self._dense = None


def _domain_error(exc: grpc.RpcError) -> KVSieveError:
    return error_for(exc.code(), exc.details() or "")


def _ctx(model: ModelSpec, namespace: str) -> pb.RequestContext:
    validate_namespace(namespace)
    return ctx_to_pb(model, namespace)


def _tokens(tokens: Tokens) -> Array:
    return as_token_array(tokens)
