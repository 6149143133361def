"""The LoadLayers RPC: a layer-by-layer load (query-aware selection) over one bidi stream.

The engine cannot say which chunks of layer L it needs before it has computed
layer L's queries, so the load is a conversation: the client opens the prefix,
then per layer asks for the key summary and, once it has chosen, for the chunks.
Each request gets exactly one answer. The store's `LayeredLoad` pins the blocks
for the stream's lifetime, and the pin counts against the namespace's pin quota
like a lease. Every wait on the client is bounded by `idle_s`: for `open`, for each
request, and for each answer to be taken (a send blocked on flow control by a
client that stops reading), so an idle, stalled or vanished engine loses the
stream and the pin within `idle_s`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractContextManager
from typing import Any

import numpy as np

from importance.lowbit import LowBitKeys, pack_codes
from kvstore._generated.kvsieve.v1 import kvsieve_pb2 as pb
from kvstore.errors import InvalidInputError
from kvstore.model import ModelSpec
from kvstore.server.backend import LowBitLayers, SidecarStore
from kvstore.server.limits import check_token_count, within

Array = np.ndarray[Any, Any]
#: ctx -> (model, namespace, caller's token); raises when the caller may not use the namespace
#: (or, a stream slot being taken for it, has too many streams open).
Authorise = Callable[[pb.RequestContext], tuple[ModelSpec, str, str | None]]
#: (namespace, pinned block keys) -> the pin counted against the namespace's quota while open.
HoldPins = Callable[[str, tuple[bytes, ...]], AbstractContextManager[None]]
#: Writes one answer to the client (grpc's `context.write`).
Send = Callable[[pb.LayersResponse], Awaitable[None]]


async def serve_layers(
    store: SidecarStore,
    requests: AsyncIterator[pb.LayersRequest],
    send: Send,
    authorise: Authorise,
    hold_pins: HoldPins,
    *,
    max_tokens: int,
    max_message_bytes: int,
    idle_s: float,
    gone: Callable[[], bool],
) -> None:
    """Answer one LoadLayers stream (see module docstring). Raises LimitExceededError when the
    client keeps it waiting `idle_s` seconds, and ends as soon as `gone()` (the call is over); the
    load is closed (its pin released) on every exit."""
    first = await _next(requests, idle_s)
    if first is None or first.WhichOneof("part") != "open":
        raise InvalidInputError("a LoadLayers stream must start with `open`")
    model, namespace, _ = authorise(first.open.ctx)
    tokens = _open_tokens(first.open, max_tokens)
    load = await asyncio.to_thread(store.open_layers, tokens, model=model, namespace=namespace)
    try:
        with hold_pins(namespace, load.pinned_keys):
            await _send(send, _header(load), idle_s, gone)
            if not load.matched_tokens:
                return
            while (message := await _next(requests, idle_s)) is not None:
                if message.WhichOneof("part") != "read":
                    raise InvalidInputError("after `open`, a LoadLayers stream carries only `read` requests")
                answer = await asyncio.to_thread(_answer, load, message.read, model, max_message_bytes)
                answer.bytes_read, answer.delivered_tokens = load.bytes_read, load.delivered_tokens
                await _send(send, answer, idle_s, gone)
    finally:
        load.close()


def _header(load: LowBitLayers) -> pb.LayersResponse:
    return pb.LayersResponse(
        header=pb.LayersHeader(
            matched_tokens=load.matched_tokens, chunk_tokens=load.chunk_tokens,
            num_layers=load.num_layers, prefix_bytes=load.prefix_bytes, summary_bytes=load.summary_bytes,
        )
    )  # fmt: skip


async def _next(requests: AsyncIterator[pb.LayersRequest], idle_s: float) -> pb.LayersRequest | None:
    refusal = f"LoadLayers: no request for {idle_s:g} s (layers_idle_s); the load was released"
    return await within(anext(requests, None), idle_s, refusal)


async def _send(send: Send, answer: pb.LayersResponse, idle_s: float, gone: Callable[[], bool]) -> None:
    refusal = f"LoadLayers: the client took no answer for {idle_s:g} s (layers_idle_s); the load was released"
    await within(send(answer), idle_s, refusal, gone=gone)


def _open_tokens(request: pb.LayersOpen, max_tokens: int) -> Array:
    packed = request.tokens_u32le
    if not packed or len(packed) % 4:
        raise InvalidInputError(
            f"open.tokens_u32le must be a non-empty run of u32 tokens, got {len(packed)} B"
        )
    check_token_count(len(packed) // 4, max_tokens, "max_lookup_tokens")
    return np.frombuffer(packed, "<u4").astype(np.uint32)


def _answer(
    load: LowBitLayers, read: pb.LayerRead, model: ModelSpec, max_message_bytes: int
) -> pb.LayersResponse:
    if read.summary:
        if read.chunks_u32le:
            raise InvalidInputError("read: a summary request names no chunks")
        return pb.LayersResponse(summary=summary_to_pb(read.layer, load.lowbit_summary(read.layer)))
    if len(read.chunks_u32le) % 4:
        raise InvalidInputError(f"read.chunks_u32le: {len(read.chunks_u32le)} B is not a run of u32")
    chunks = np.frombuffer(read.chunks_u32le, "<u4").astype(np.int64)
    layer_token_bytes = model.token_bytes // model.num_layers
    wanted = len(chunks) * load.chunk_tokens * layer_token_bytes
    if wanted > max_message_bytes - (1 << 16):
        raise InvalidInputError(
            f"read: {len(chunks)} chunks are {wanted} B, above max_message_bytes {max_message_bytes}: "
            "ask for them in several reads"
        )
    piece = load.read_layer(read.layer, chunks.tolist())
    return pb.LayersResponse(
        data=pb.LayerData(
            layer=read.layer,
            positions_u32le=np.asarray(piece.positions, "<u4").tobytes(),
            kv=np.ascontiguousarray(piece.kv).tobytes(),
        )
    )


def summary_to_pb(layer: int, keys: LowBitKeys) -> pb.LayerSummary:
    """The wire form of a layer's low-bit summary."""
    heads, n, dim = keys.codes.shape
    return pb.LayerSummary(
        layer=layer, kv_heads=heads, num_tokens=n, head_dim=dim, bits=keys.bits,
        group_tokens=keys.group_tokens, codes=pack_codes(keys.codes, keys.bits),
        low_f16=np.ascontiguousarray(keys.low, "<f2").tobytes(),
        step_f16=np.ascontiguousarray(keys.step, "<f2").tobytes(),
    )  # fmt: skip
