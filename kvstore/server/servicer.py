"""The KVCache gRPC servicer: decode, authorise, call the store, encode. Nothing else.

Store calls block (LMDB, numpy), so they run in worker threads and the event
loop stays free for other streams.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
import numpy as np
from typing_extensions import override

from kvstore._generated.kvsieve.v1 import kvsieve_pb2 as pb
from kvstore._generated.kvsieve.v1 import kvsieve_pb2_grpc as pb_grpc
from kvstore.errors import InvalidInputError, NotFoundError
from kvstore.model import ModelSpec
from kvstore.server.arenas import ArenaCache
from kvstore.server.auth import Authorizer
from kvstore.server.config import ServerConfig
from kvstore.server.metrics import Metrics
from kvstore.shm import Segment, dense_view
from kvstore.store import LoadedChunk, LoadStream, TieredStore
from kvstore.wire import (
    ctx_from_pb,
    kv_from_bytes,
    stats_to_pb,
    status_for,
    tokens_from_pb,
)

# Chunks per message (and per worker-thread hop): amortises both, and bounds latency.
_CHUNKS_PER_MESSAGE = 16


class KVCacheServicer(pb_grpc.KVCacheServicer):
    """Thin adapter from the wire contract to `TieredStore`."""

    def __init__(self, store: TieredStore, config: ServerConfig, metrics: Metrics) -> None:
        self._store = store
        self._config = config
        self._metrics = metrics
        self._auth = Authorizer(config.auth_tokens)
        self._lease_namespaces: dict[str, str] = {}
        self.arenas = ArenaCache()

    @override
    async def Lookup(self, request: pb.LookupRequest, context: Any) -> pb.LookupResponse:
        async with self._guard(context):
            model, namespace = self._authorised(context, request.ctx)
            tokens = tokens_from_pb(request.tokens)
            if self._store.local_only:  # O(blocks) dict probes: cheaper than a thread hop
                result = self._store.lookup(tokens, model=model, namespace=namespace)
            else:
                result = await asyncio.to_thread(self._store.lookup, tokens, model=model, namespace=namespace)
            return pb.LookupResponse(
                num_tokens=result.num_tokens,
                num_blocks=result.num_blocks,
                memory_blocks=result.memory_blocks,
            )

    @override
    async def Store(self, request_iterator: AsyncIterator[pb.StoreRequest], context: Any) -> pb.StoreResponse:
        async with self._guard(context), self._streaming():
            first = await anext(aiter(request_iterator), None)
            if first is None or first.WhichOneof("part") != "header":
                raise InvalidInputError("a Store stream must start with a header")
            header = first.header
            model, namespace = self._authorised(context, header.ctx)
            tokens = tokens_from_pb(header.tokens)
            if len(tokens) > self._config.max_store_tokens:
                raise InvalidInputError(
                    f"tokens: {len(tokens)} exceeds max_store_tokens {self._config.max_store_tokens}"
                )
            kv_start = header.kv_start
            if kv_start > len(tokens):
                raise InvalidInputError(f"kv_start {kv_start} is beyond the {len(tokens)} tokens")
            kv = np.empty(model.kv_shape(len(tokens) - kv_start), model.np_dtype)
            filled = 0
            async for message in request_iterator:
                if message.WhichOneof("part") != "slice":
                    raise InvalidInputError("after the header, a Store stream carries only slices")
                filled = _place_slice(kv, message.slice, filled, kv_start, model)
            if filled != kv.shape[3]:
                raise InvalidInputError(f"slices cover {filled} of {kv.shape[3]} tokens; nothing was stored")
            scores = np.asarray(header.scores, np.float32) if len(header.scores) else None
            result = await asyncio.to_thread(
                self._store.store, tokens, kv, model=model, namespace=namespace, scores=scores,
                kv_start=kv_start,
            )  # fmt: skip
            return pb.StoreResponse(
                num_tokens=result.num_tokens,
                new_blocks=result.new_blocks,
                bytes_written=result.bytes_written,
            )

    @override
    async def Load(self, request: pb.LoadRequest, context: Any) -> AsyncIterator[pb.LoadResponse]:
        async with self._guard(context), self._streaming():
            started = time.perf_counter()
            model, namespace = self._authorised(context, request.ctx)
            tokens = tokens_from_pb(request.tokens)
            stream = await asyncio.to_thread(
                self._store.load, tokens, model=model, namespace=namespace,
                budget=request.budget or 1.0, budget_tokens=request.budget_tokens or None,
            )  # fmt: skip
            segment = self.arenas.acquire(request.shm_name) if request.shm_name and self._config.shm else None
            try:
                yield pb.LoadResponse(
                    header=pb.LoadHeader(
                        matched_tokens=stream.matched_tokens,
                        selected_tokens=stream.selected_tokens,
                        shm=segment is not None,
                    )
                )
                writer = _ChunkWriter(stream, segment, model)
                limit = self._config.max_message_bytes // 2
                while message := await asyncio.to_thread(writer.next_batch, _CHUNKS_PER_MESSAGE, limit):
                    yield message
            finally:
                if segment is not None:
                    self.arenas.done(request.shm_name)
            yield pb.LoadResponse(
                trailer=pb.LoadTrailer(
                    num_tokens=stream.num_tokens,
                    bytes_read=stream.bytes_read,
                    read_amplification=stream.read_amplification,
                    delivered_tokens=stream.delivered_tokens,
                )
            )
            self._metrics.load_seconds.observe(time.perf_counter() - started)
            if stream.selected_tokens:
                self._metrics.read_amplification.observe(stream.read_amplification)

    @override
    async def ReportScores(self, request: pb.ReportScoresRequest, context: Any) -> pb.ReportScoresResponse:
        async with self._guard(context):
            model, namespace = self._authorised(context, request.ctx)
            tokens = tokens_from_pb(request.tokens)
            scores = np.asarray(request.scores, np.float32)
            updated = await asyncio.to_thread(
                self._store.report_scores, tokens, scores, model=model, namespace=namespace
            )
            return pb.ReportScoresResponse(blocks_updated=updated)

    @override
    async def Pin(self, request: pb.PinRequest, context: Any) -> pb.PinResponse:
        async with self._guard(context):
            model, namespace = self._authorised(context, request.ctx)
            tokens = tokens_from_pb(request.tokens)
            ttl = request.ttl_s or 60.0
            lease = await asyncio.to_thread(
                self._store.pin, tokens, model=model, namespace=namespace, ttl_s=ttl
            )
            self._lease_namespaces[lease.lease_id] = namespace
            return pb.PinResponse(lease_id=lease.lease_id, num_blocks=len(lease.keys), ttl_s=ttl)

    @override
    async def Unpin(self, request: pb.UnpinRequest, context: Any) -> pb.UnpinResponse:
        async with self._guard(context):
            token = self._auth.caller(context.invocation_metadata())
            namespace = self._lease_namespaces.get(request.lease_id)
            if namespace is None:
                raise NotFoundError(f"unknown lease {request.lease_id!r}")
            self._auth.check(token, namespace)
            await asyncio.to_thread(self._store.unpin, request.lease_id)
            self._lease_namespaces.pop(request.lease_id, None)
            return pb.UnpinResponse()

    @override
    async def Stats(self, request: pb.StatsRequest, context: Any) -> pb.StatsResponse:
        async with self._guard(context):
            self._auth.caller(context.invocation_metadata())
            return stats_to_pb(await asyncio.to_thread(self._store.stats))

    @override
    async def ReleaseSegment(
        self, request: pb.ReleaseSegmentRequest, context: Any
    ) -> pb.ReleaseSegmentResponse:
        async with self._guard(context):
            self._auth.caller(context.invocation_metadata())
            self.arenas.release(request.shm_name)
            return pb.ReleaseSegmentResponse()

    # -- helpers ------------------------------------------------------------------

    def _authorised(self, context: Any, ctx: pb.RequestContext) -> Any:
        token = self._auth.caller(context.invocation_metadata())
        model, namespace = ctx_from_pb(ctx)
        self._auth.check(token, namespace)
        return model, namespace

    def _guard(self, context: Any) -> _Guard:
        return _Guard(context)

    def _streaming(self) -> _Streaming:
        return _Streaming(self._metrics)


class _Guard:
    """Maps any domain error raised inside to a status via `status_for`, then aborts."""

    def __init__(self, context: Any) -> None:
        self._context = context

    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        if exc is None or isinstance(exc, (asyncio.CancelledError, GeneratorExit, grpc.aio.AbortError)):
            return
        if not isinstance(exc, Exception):
            return
        code = status_for(exc)
        details = (
            str(exc) if code != grpc.StatusCode.INTERNAL else f"internal error: {type(exc).__name__}: {exc}"
        )
        await self._context.abort(code, details)


class _Streaming:
    def __init__(self, metrics: Metrics) -> None:
        self._gauge = metrics.active_streams

    async def __aenter__(self) -> None:
        self._gauge.inc()

    async def __aexit__(self, *exc: object) -> None:
        self._gauge.dec()


class _ChunkWriter:
    """Turns loaded chunks into messages in a worker thread, into shm when there is room."""

    def __init__(self, stream: LoadStream, segment: Segment | None, model: ModelSpec) -> None:
        self._chunks: Iterator[LoadedChunk] = iter(stream)
        self._dense = None if segment is None else dense_view(segment.buf, model)
        self._slot = 0

    def next_batch(self, max_chunks: int, max_bytes: int) -> pb.LoadResponse | None:
        """One message with up to `max_chunks` chunks and about `max_bytes` inline bytes."""
        response = pb.LoadResponse()
        batch = response.batch
        inline = 0
        for chunk in self._chunks:
            inline += self._fill(batch.chunks.add(), chunk)  # in place: no sub-message copy
            if len(batch.chunks) == max_chunks or inline >= max_bytes:
                break
        return response if len(batch.chunks) else None

    def _fill(self, message: pb.Chunk, chunk: LoadedChunk) -> int:
        """Fill `message`; returns the bytes placed inline (0 when they went to shm)."""
        message.block_index, message.chunk_index, message.tier = (
            chunk.block_index,
            chunk.chunk_index,
            chunk.tier,
        )
        message.positions.extend(chunk.positions.tolist())
        n = len(chunk.positions)
        if self._dense is not None and self._slot + n <= self._dense.shape[3]:
            self._dense[:, :, :, self._slot : self._slot + n] = chunk.kv
            message.shm.slot, message.shm.num_tokens = self._slot, n
            self._slot += n
            return 0
        message.data = np.ascontiguousarray(chunk.kv).tobytes()
        return int(chunk.kv.nbytes)


def _place_slice(kv: np.ndarray[Any, Any], part: pb.KVSlice, filled: int, kv_start: int, model: Any) -> int:
    """Copy one slice into `kv` (tokens from kv_start on); slices arrive in order."""
    if (
        part.start_token != kv_start + filled
        or part.num_tokens == 0
        or filled + part.num_tokens > kv.shape[3]
    ):
        raise InvalidInputError(
            f"slice.start_token={part.start_token}, num_tokens={part.num_tokens}: expected a slice "
            f"starting at {kv_start + filled} within {kv.shape[3]} tokens"
        )
    data = kv_from_bytes(part.data, model, part.num_tokens, "slice.data")
    kv[:, :, :, filled : filled + part.num_tokens] = data
    return filled + part.num_tokens
