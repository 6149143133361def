"""KVClient: the `PrefixStore` of a sidecar, over gRPC.

It implements `kvstore.api.PrefixStore` (the contract is documented there) like the
embedded `TieredStore`, so callers switch between the two by configuration. It
imports neither the store nor its tiers (no lmdb, no redis). Co-located with the
server, loads arrive through shared memory (kvstore/client/arenas.py).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np

from kvstore._generated.kvsieve.v1 import kvsieve_pb2 as pb
from kvstore._generated.kvsieve.v1 import kvsieve_pb2_grpc as pb_grpc
from kvstore.api import Lease, StoreInfo, Tokens
from kvstore.budget import Budget, resolve_budget
from kvstore.client.arenas import ArenaPool, ClientArena
from kvstore.client.layer_by_layer import EmptyLayeredLoad, RemoteLayeredLoad
from kvstore.client.stream import RemoteLoadStream, domain_error
from kvstore.errors import InvalidInputError, NotFoundError, RpcFailedError
from kvstore.keys import as_token_array, validate_namespace
from kvstore.model import ModelSpec
from kvstore.rpc import shm
from kvstore.rpc.channel import channel_options, is_loopback
from kvstore.rpc.messages import budget_to_fields, ctx_to_pb, kv_bytes, kv_from_bytes, stats_from_pb
from kvstore.stats import StoreStats
from kvstore.values import DEFAULT_NAMESPACE, LookupResult, StoreResult, validate_kv

Array = np.ndarray[Any, Any]
# Below this, a Store's KV goes as slices: CreateArena and the pool cost more than the copies.
_SHM_STORE_MIN_BYTES = 64 << 10


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

    def lookup_many(self, token_lists: Array, *, model: ModelSpec, namespace: str = DEFAULT_NAMESPACE) -> int:
        """How many rows of `token_lists` (k, n), from the first, are cached whole, each looked
        up from the root on its own: one round trip. Raises `RpcFailedError` (UNIMPLEMENTED)
        from a server older than this RPC."""
        lists = np.asarray(token_lists)
        if lists.ndim != 2 or lists.shape[1] == 0:
            raise InvalidInputError(f"token_lists must have shape (lists, tokens > 0), got {lists.shape}")
        request = pb.LookupManyRequest(
            ctx=_ctx(model, namespace),
            tokens_u32le=_tokens(lists.reshape(-1)).astype("<u4", copy=False).tobytes(),
            list_tokens=lists.shape[1],
        )
        return int(self._call(self._stub.LookupMany, request).leading_cached)

    def load_many(
        self, token_lists: Array, *, model: ModelSpec, namespace: str = DEFAULT_NAMESPACE
    ) -> Iterator[tuple[int, int, Array]]:
        """Each row of `token_lists` (k, n) loaded whole from the root on its own, in one stream.

        Yields (row, tokens delivered, kv of shape (layers, 2, heads, delivered, dim)) per row,
        in order; fewer than n tokens delivered means part of that row was not cached. A `kv`
        is valid only until the next item (it may be a view of a shared-memory arena); leaving
        the loop early cancels the call. Raises `RpcFailedError` (UNIMPLEMENTED) from a
        server older than this RPC.
        """
        lists = np.asarray(token_lists)
        if lists.ndim != 2 or lists.shape[1] == 0:
            raise InvalidInputError(f"token_lists must have shape (lists, tokens > 0), got {lists.shape}")
        n = lists.shape[1]
        request = pb.LoadManyRequest(
            ctx=_ctx(model, namespace),
            tokens_u32le=_tokens(lists.reshape(-1)).astype("<u4", copy=False).tobytes(),
            list_tokens=n,
        )
        self._release_orphans()
        arena = (
            self._arenas.take(namespace, lists.size * model.token_bytes) if self._shm and lists.size else None
        )
        if arena is not None:
            request.arena_id = arena.arena_id
        responses, finished = None, False
        try:
            responses = self._stub.LoadMany(request, timeout=self._timeout, metadata=self._metadata)
            flat = None if arena is None else np.frombuffer(arena.buf, np.uint8)
            size = n * model.token_bytes
            for reply in responses:
                if reply.shm and flat is not None:  # the list's own dense array
                    own = flat[reply.index * size : (reply.index + 1) * size].view(model.np_dtype)
                    yield (
                        reply.index,
                        reply.num_tokens,
                        own.reshape(model.kv_shape(n))[:, :, :, : reply.num_tokens],
                    )
                else:
                    yield (
                        reply.index,
                        reply.num_tokens,
                        kv_from_bytes(reply.kv, model, reply.num_tokens, "kv"),
                    )
            finished = True
        except grpc.RpcError as exc:
            raise domain_error(exc) from None
        finally:
            flat = None  # no view may outlive the loan of the arena
            if responses is not None and not finished:
                responses.cancel()
            if arena is not None:
                (self._arenas.give if finished else self._arenas.discard)(arena)

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
        if self._shm and kv.nbytes >= _SHM_STORE_MIN_BYTES:
            through_arena = self._store_through_arena(header, kv, namespace)
            if through_arena is not None:
                return through_arena
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

    def _store_through_arena(self, header: pb.StoreHeader, kv: Array, namespace: str) -> StoreResult | None:
        """Store with the KV written into an arena (one copy each side); None: send slices instead."""
        self._release_orphans()
        arena = self._arenas.take(namespace, kv.nbytes)
        if arena is None:
            return None
        if not arena.writable:  # an older server: it reads Stores as slices only
            self._arenas.give(arena)
            return None
        view = np.frombuffer(arena.buf, kv.dtype, kv.size).reshape(kv.shape)
        view[...] = kv
        del view  # no export may outlive the write: the pool may unmap the arena
        header.arena_id = arena.arena_id
        try:
            reply = self._stub.Store(
                iter([pb.StoreRequest(header=header)]), timeout=self._timeout, metadata=self._metadata
            )
        except grpc.RpcError as exc:
            error = domain_error(exc)
            # Never reuse an arena whose Store failed: after a client-side deadline the server
            # may still be copying from it, and a reuse would tear that store (docs/sidecar.md).
            self._arenas.discard(arena)
            if isinstance(error, NotFoundError):  # swept or busy there: slices instead
                header.arena_id = ""
                return None
            raise error from None
        self._arenas.give(arena)
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

    def open_layers(
        self, tokens: Tokens, *, model: ModelSpec, namespace: str = DEFAULT_NAMESPACE
    ) -> RemoteLayeredLoad | EmptyLayeredLoad:
        """One LoadLayers stream (kvstore/client/layer_by_layer.py); matched 0 from a server without it."""
        toks = _tokens(tokens)
        request = pb.LayersOpen(ctx=_ctx(model, namespace), tokens_u32le=toks.astype("<u4").tobytes())

        def start(requests: Any) -> Any:
            return self._stub.LoadLayers(requests, timeout=self._timeout, metadata=self._metadata)

        try:
            return RemoteLayeredLoad(start, request, model)
        except RpcFailedError as exc:
            if exc.code == grpc.StatusCode.UNIMPLEMENTED:  # an older server: no layer-by-layer loads
                return EmptyLayeredLoad(model)
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
            buf = shm.map_arena(ref, writable=reply.accepts_store)
        except OSError:  # another host, pid namespace or uid: inline from now on
            self._shm = False
            self._release_segment(reply.arena_id, namespace)
            return None
        return ClientArena(reply.arena_id, namespace, buf, reply.accepts_store)

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
            raise domain_error(exc) from None


def _ctx(model: ModelSpec, namespace: str) -> pb.RequestContext:
    validate_namespace(namespace)
    return ctx_to_pb(model, namespace)


def _tokens(tokens: Tokens) -> Array:
    return as_token_array(tokens)
