"""The KVCache gRPC servicer: decode, authorise, bound, call the store, encode.

Store calls block (LMDB, numpy), so they run in worker threads and the event
loop stays free for other streams; so does any Lookup longer than a few
thousand tokens. Limits and tenant quotas are checked before the work they
bound (see kvstore.server.limits).

Streams (Store, Load, LoadLayers) write their answers with `context.write` under an
idle limit and read each request under one, so no wait on a client is unbounded;
each holds one of its tenant's stream slots until grpc has finished the call (its
status delivered or the call cancelled), because until then the call also holds
one of grpc's `max_concurrent_rpcs`.

The handlers stay thin: Load's and LoadMany's replies are written by
kvstore/server/load_reply.py, a Store's bounds and KV come through
kvstore/server/store_intake.py, and pins meet their quota in kvstore/server/pins.py.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import AbstractContextManager
from functools import partial
from typing import Any

import numpy as np
from typing_extensions import override

from kvstore._generated.kvsieve.v1 import kvsieve_pb2 as pb
from kvstore._generated.kvsieve.v1 import kvsieve_pb2_grpc as pb_grpc
from kvstore.api import Lease
from kvstore.errors import ArenaLimitError, InvalidInputError, NotFoundError
from kvstore.keys import validate_namespace
from kvstore.model import ModelSpec
from kvstore.rpc.messages import ctx_from_pb, stats_to_pb
from kvstore.rpc.shm import ServerArena
from kvstore.server import many
from kvstore.server.arenas import ArenaCache, ArenaLimits, Owner
from kvstore.server.auth import Authorizer
from kvstore.server.backend import SidecarStore
from kvstore.server.config import ServerConfig
from kvstore.server.guard import CallGuard, StreamGauge
from kvstore.server.layers import serve_layers
from kvstore.server.limits import (
    ByteBudget,
    StreamSlot,
    StreamSlots,
    TenantLeases,
    check_token_count,
    request_tokens,
    tenant_of,
    token_count,
    tokens_array,
    within,
)
from kvstore.server.load_reply import Reply, load_trailer, open_load, send_chunks, send_lists, send_load
from kvstore.server.metrics import Metrics
from kvstore.server.pins import pin_admitted, pinned_quota
from kvstore.server.store_intake import check_namespace_bytes, receive_kv, store_bytes
from kvstore.server.tenants import TenantCounters, tenant_stats
from kvstore.values import LookupResult

# Chunks per message (and per worker-thread hop): amortises both, and bounds latency.
_CHUNKS_PER_MESSAGE = 16
# Through shared memory a chunk is a small descriptor: far fewer messages and thread hops.
_SHM_CHUNKS_PER_MESSAGE = 256
# Lookups up to this many tokens run on the event loop (cheaper than a thread hop).
_INLINE_LOOKUP_TOKENS = 4096
# A LookupMany walks its rows in one pass over one conversion of all their tokens (75 us for
# 128 pages of 64 tokens in-process): a thread hop costs more than the walk up to this many.
_INLINE_LOOKUP_MANY_TOKENS = 1 << 15


class KVCacheServicer(pb_grpc.KVCacheServicer):
    """Thin adapter from the wire contract to a `SidecarStore` (kvstore/server/backend.py)."""

    def __init__(self, store: SidecarStore, config: ServerConfig, metrics: Metrics) -> None:
        self._store = store
        self._config = config
        self._metrics = metrics
        self._auth = Authorizer(config.auth_tokens)
        self.arenas = ArenaCache(
            ArenaLimits(arena_bytes=config.shm_arena_bytes, namespace_bytes=config.shm_namespace_bytes,
                        total_bytes=config.shm_total_bytes, idle_s=config.shm_idle_s)
        )  # fmt: skip
        quota = pinned_quota(store, config.namespace_pinned_fraction)
        self.leases = TenantLeases(config.namespace_max_leases, quota, self._block_bytes)
        self._inflight = ByteBudget(
            config.max_inflight_store_bytes, "max_inflight_store_bytes",
            config.inflight_bytes_per_tenant, "namespace_max_inflight_bytes",
        )  # fmt: skip
        self._streams = StreamSlots(config.streams_per_tenant, "namespace_max_streams")
        self._tenants = TenantCounters()
        metrics.inflight_store_bytes.set_function(lambda: self._inflight.used)
        metrics.arenas.set_function(lambda: len(self.arenas))

    @override
    async def Lookup(self, request: pb.LookupRequest, context: Any) -> pb.LookupResponse:
        async with self._guard(context):
            model, namespace, _ = self._authorised(context, request.ctx)
            if self._store.local_only and token_count(request) <= _INLINE_LOOKUP_TOKENS:
                result = self._lookup(request, model, namespace)
            else:  # long lists (or a remote probe) would stall every other client's call
                result = await asyncio.to_thread(self._lookup, request, model, namespace)
            self._tenants.add(namespace, {"lookups": 1, "lookup_hits": int(result.num_tokens > 0)})
            return pb.LookupResponse(
                num_tokens=result.num_tokens,
                num_blocks=result.num_blocks,
                memory_blocks=result.memory_blocks,
                packed_tokens=True,
            )

    @override
    async def LookupMany(self, request: pb.LookupManyRequest, context: Any) -> pb.LookupManyResponse:
        async with self._guard(context):
            model, namespace, _ = self._authorised(context, request.ctx)
            if self._store.local_only and len(request.tokens_u32le) // 4 <= _INLINE_LOOKUP_MANY_TOKENS:
                cached = self._lookup_many(request, model, namespace)
            else:
                cached = await asyncio.to_thread(self._lookup_many, request, model, namespace)
            self._tenants.add(namespace, {"lookups": 1, "lookup_hits": int(cached > 0)})
            return pb.LookupManyResponse(leading_cached=cached)

    @override
    async def LoadMany(self, request: pb.LoadManyRequest, context: Any) -> None:
        async with self._guard(context), self._streaming():
            slot = self._stream_slot(context)
            model, namespace, token = self._authorised(context, request.ctx)
            slot.claim(tenant_of(token, namespace))
            lists = await asyncio.to_thread(many.token_lists, request, self._config.max_lookup_tokens)
            arena = self._acquire_arena(request.arena_id, Owner(token, namespace))
            try:
                send = partial(self._send_load, context)
                bytes_read = await send_lists(send, self._store, lists, model, namespace, arena)
            finally:
                if arena is not None:
                    self.arenas.done(request.arena_id)
            self._tenants.add(namespace, {"loads": len(lists), "bytes_read": bytes_read})

    @override
    async def Store(self, request_iterator: AsyncIterator[pb.StoreRequest], context: Any) -> pb.StoreResponse:
        async with self._guard(context), self._streaming():
            slot, idle = self._stream_slot(context), self._config.stream_idle_s
            refusal = f"Store: no header for {idle:g} s (stream_idle_s)"
            first = await within(anext(aiter(request_iterator), None), idle, refusal)
            if first is None or first.WhichOneof("part") != "header":
                raise InvalidInputError("a Store stream must start with a header")
            header = first.header
            model, namespace, token = self._authorised(context, header.ctx)
            tenant = tenant_of(token, namespace)
            slot.claim(tenant)
            tokens = tokens_array(header.tokens, self._config.max_store_tokens, "max_store_tokens")
            kv_start = header.kv_start
            if kv_start > len(tokens):
                raise InvalidInputError(f"kv_start {kv_start} is beyond the {len(tokens)} tokens")
            nbytes = store_bytes(model, len(tokens) - kv_start, self._config.max_store_bytes)
            await check_namespace_bytes(self._store, namespace, self._config.namespace_max_bytes)
            with self._inflight.reserve(nbytes, tenant):  # before the allocation it bounds
                shape = model.kv_shape(len(tokens) - kv_start)
                kv, release = await receive_kv(
                    request_iterator, header, Owner(token, namespace), model, shape,
                    arenas=self.arenas, shm=self._config.shm, idle_s=idle,
                )  # fmt: skip
                try:  # an arena's view: the Store's encoding is its one copy (store_intake.py)
                    scores = np.asarray(header.scores, np.float32) if len(header.scores) else None
                    result = await asyncio.to_thread(
                        self._store.store, tokens, kv, model=model, namespace=namespace, scores=scores,
                        kv_start=kv_start,
                    )  # fmt: skip
                finally:
                    del kv
                    release()
            self._tenants.add(namespace, {"stores": 1, "blocks_written": result.new_blocks,
                                          "bytes_written": result.bytes_written})  # fmt: skip
            return pb.StoreResponse(
                num_tokens=result.num_tokens,
                new_blocks=result.new_blocks,
                bytes_written=result.bytes_written,
            )

    @override
    async def Load(self, request: pb.LoadRequest, context: Any) -> None:
        async with self._guard(context), self._streaming():
            slot, started = self._stream_slot(context), time.perf_counter()
            model, namespace, token = self._authorised(context, request.ctx)
            slot.claim(tenant_of(token, namespace))
            check_token_count(token_count(request), self._config.max_lookup_tokens, "max_lookup_tokens")
            arena = self._acquire_arena(request.arena_id, Owner(token, namespace))
            max_tokens = self._config.max_lookup_tokens
            try:
                stream = await asyncio.to_thread(
                    open_load, self._store, request, model, namespace, max_tokens
                )
                batches = (_CHUNKS_PER_MESSAGE, self._config.max_message_bytes // 2, _SHM_CHUNKS_PER_MESSAGE)
                await send_chunks(partial(self._send_load, context), stream, request, model, arena, batches)
            finally:
                if arena is not None:  # after the chunk writer's views of it are closed
                    self.arenas.done(request.arena_id)
            await self._send_load(context, load_trailer(stream))
            self._tenants.add(namespace, {"loads": 1, "bytes_read": stream.bytes_read})
            self._metrics.load_seconds.observe(time.perf_counter() - started)
            if stream.selected_tokens:
                self._metrics.read_amplification.observe(stream.read_amplification)

    @override
    async def LoadLayers(self, request_iterator: AsyncIterator[pb.LayersRequest], context: Any) -> None:
        async with self._guard(context), self._streaming():
            slot = self._stream_slot(context)

            def authorise(ctx: pb.RequestContext) -> tuple[ModelSpec, str, str | None]:
                model, namespace, token = self._authorised(context, ctx)
                slot.claim(tenant_of(token, namespace))
                return model, namespace, token

            await serve_layers(
                self._store, request_iterator, context.write, authorise, self._hold_pins,
                max_tokens=self._config.max_lookup_tokens, max_message_bytes=self._config.max_message_bytes,
                idle_s=self._config.layers_idle_s, gone=context.done,
            )  # fmt: skip

    @override
    async def ReportScores(self, request: pb.ReportScoresRequest, context: Any) -> pb.ReportScoresResponse:
        async with self._guard(context):
            model, namespace, _ = self._authorised(context, request.ctx)
            updated = await asyncio.to_thread(self._report_scores, request, model, namespace)
            self._tenants.add(namespace, {"score_reports": 1})
            return pb.ReportScoresResponse(blocks_updated=updated)

    @override
    async def Pin(self, request: pb.PinRequest, context: Any) -> pb.PinResponse:
        async with self._guard(context):
            model, namespace, _ = self._authorised(context, request.ctx)
            ttl = request.ttl_s or 60.0
            lease = await asyncio.to_thread(self._pin, request.tokens, model, namespace, ttl)
            self._tenants.add(namespace, {"pins": 1})
            return pb.PinResponse(lease_id=lease.lease_id, num_blocks=lease.num_keys, ttl_s=ttl)

    @override
    async def Unpin(self, request: pb.UnpinRequest, context: Any) -> pb.UnpinResponse:
        async with self._guard(context):
            token = self._auth.caller(context.invocation_metadata())
            namespace = self.leases.namespace_of(request.lease_id)
            if namespace is None:
                raise NotFoundError(f"unknown lease {request.lease_id!r} (never granted, released, expired)")
            self._auth.check(token, namespace)
            await asyncio.to_thread(self._store.unpin, request.lease_id)
            self.leases.forget(request.lease_id)
            return pb.UnpinResponse()

    @override
    async def Stats(self, request: pb.StatsRequest, context: Any) -> pb.StatsResponse:
        async with self._guard(context):
            scope = self._auth.scope(self._auth.caller(context.invocation_metadata()))
            if scope is None:  # an admin (or no auth): the whole store
                return stats_to_pb(await asyncio.to_thread(self._store.stats))
            stats = await asyncio.to_thread(
                tenant_stats, self._store, self._tenants, scope, self.leases.count(scope)
            )
            return stats_to_pb(stats)

    @override
    async def CreateArena(self, request: pb.CreateArenaRequest, context: Any) -> pb.CreateArenaResponse:
        async with self._guard(context):
            owner = self._owner(context, request.namespace)
            if not self._config.shm:
                raise ArenaLimitError("shared memory is disabled on this server (shm = false)")
            arena_id, ref = await asyncio.to_thread(
                self.arenas.create, owner, request.nbytes, request.client_pid
            )
            return pb.CreateArenaResponse(
                arena_id=arena_id,
                server_pid=ref.pid,
                fd=ref.fd,
                nbytes=ref.nbytes,
                inode=ref.inode,
                accepts_store=True,
            )

    @override
    async def ReleaseSegment(
        self, request: pb.ReleaseSegmentRequest, context: Any
    ) -> pb.ReleaseSegmentResponse:
        async with self._guard(context):
            owner = self._owner(context, request.namespace)
            if request.arena_id:  # an old client names a /dev/shm file: nothing of ours to release
                self.arenas.release(request.arena_id, owner)
            return pb.ReleaseSegmentResponse()

    # -- helpers ------------------------------------------------------------------

    def _authorised(self, context: Any, ctx: pb.RequestContext) -> tuple[ModelSpec, str, str | None]:
        token = self._auth.caller(context.invocation_metadata())
        model, namespace = ctx_from_pb(ctx)
        self._auth.check(token, namespace)
        return model, namespace, token

    def _owner(self, context: Any, namespace: str) -> Owner:
        token = self._auth.caller(context.invocation_metadata())
        namespace = namespace or "default"
        validate_namespace(namespace)
        self._auth.check(token, namespace)
        return Owner(token, namespace)

    def _stream_slot(self, context: Any) -> StreamSlot:
        """The call's slot among its tenant's streams: taken now when the bearer token names the
        tenant (else by the caller once the namespace is known), given back when grpc has
        finished the call, not when the handler returns: a status queued behind answers the
        client does not read keeps the call, and one of grpc's call slots, alive."""
        slot = StreamSlot(self._streams)
        context.add_done_callback(slot.release)
        if self._auth.enabled:
            slot.claim(tenant_of(self._auth.caller(context.invocation_metadata()), ""))
        return slot

    async def _send_load(self, context: Any, message: Reply) -> None:
        await send_load(context, message, self._config.stream_idle_s)

    def _hold_pins(self, namespace: str, keys: tuple[bytes, ...]) -> AbstractContextManager[None]:
        """A LoadLayers stream's pin, counted against its namespace's pin quota while it lives."""
        return self.leases.holding(namespace, keys)

    def _tokens(self, tokens: Any) -> np.ndarray[Any, Any]:
        return tokens_array(tokens, self._config.max_lookup_tokens, "max_lookup_tokens")

    # Worker-thread bodies: token lists are converted there, off the event loop.

    def _lookup(self, request: pb.LookupRequest, model: ModelSpec, namespace: str) -> LookupResult:
        tokens = request_tokens(request, self._config.max_lookup_tokens, "max_lookup_tokens")
        return self._store.lookup(tokens, model=model, namespace=namespace)

    def _lookup_many(self, request: pb.LookupManyRequest, model: ModelSpec, namespace: str) -> int:
        lists = many.token_lists(request, self._config.max_lookup_tokens)
        return many.leading_cached(self._store, lists, model, namespace)

    def _report_scores(self, request: pb.ReportScoresRequest, model: ModelSpec, namespace: str) -> int:
        tokens = self._tokens(request.tokens)
        scores = np.asarray(request.scores, np.float32)
        return self._store.report_scores(tokens, scores, model=model, namespace=namespace)

    def _acquire_arena(self, arena_id: str, owner: Owner) -> ServerArena | None:
        if not arena_id or not self._config.shm:
            return None
        return self.arenas.acquire(arena_id, owner)  # PermissionDeniedError before any work

    def _pin(self, tokens: Any, model: ModelSpec, namespace: str, ttl: float) -> Lease:
        return pin_admitted(self._store, self.leases, self._tokens(tokens), model, namespace, ttl)

    def _block_bytes(self, key: bytes) -> int:
        return self._store.block_bytes(key)

    def _guard(self, context: Any) -> CallGuard:
        return CallGuard(context)

    def _streaming(self) -> StreamGauge:
        return StreamGauge(self._metrics)
