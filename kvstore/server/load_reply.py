"""The replies of Load (the header, the loaded chunks in batches, the trailer) and of LoadMany
(one reply per token list, kvstore/server/many.py).

The servicer authorises the call and holds its arena; this module opens the store's
loads and writes what they deliver. Every write waits under the stream's idle limit
(`send_load`), so a client that stops reading cannot hold the call, or its chunks, for ever.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from kvstore._generated.kvsieve.v1 import kvsieve_pb2 as pb
from kvstore.api import LoadStream
from kvstore.model import ModelSpec
from kvstore.rpc.messages import budget_from_fields
from kvstore.rpc.shm import ServerArena
from kvstore.server import many
from kvstore.server.backend import SidecarStore
from kvstore.server.chunks import ChunkWriter
from kvstore.server.limits import request_tokens, within

Reply = pb.LoadResponse | pb.LoadManyResponse | bytes
Send = Callable[[Reply], Awaitable[None]]


async def send_load(context: Any, message: Reply, idle_s: float) -> None:
    """Write one answer of a Load (or LoadMany) stream; LimitExceededError if the client
    takes none for `idle_s` seconds (stream_idle_s)."""
    refusal = f"Load: the client took no answer for {idle_s:g} s (stream_idle_s); the load was ended"
    await within(context.write(message), idle_s, refusal, gone=context.done)


def open_load(
    store: SidecarStore, request: pb.LoadRequest, model: ModelSpec, namespace: str, max_tokens: int
) -> LoadStream:
    """The store's load for `request` (a worker-thread body: the token list is converted here)."""
    tokens = request_tokens(request, max_tokens, "max_lookup_tokens")
    return store.load(
        tokens, model=model, namespace=namespace,
        budget=budget_from_fields(request), budget_tokens=request.budget_tokens or None,
    )  # fmt: skip


async def send_chunks(
    send: Send,
    stream: LoadStream,
    request: pb.LoadRequest,
    model: ModelSpec,
    arena: ServerArena | None,
    batches: tuple[int, int, int],
) -> None:
    """Write the header, then the stream's chunks in batches of at most
    (chunks, bytes, chunks through shared memory) `batches` per message.

    The chunk writer is closed before this returns (it holds views of `arena`), so the
    caller may give the arena back as soon as this ends, however it ends.
    """
    header = pb.LoadHeader(
        matched_tokens=stream.matched_tokens,
        selected_tokens=stream.selected_tokens,
        shm=arena is not None,
        packed_tokens=True,
        shm_by_position=arena is not None and request.shm_by_position,
    )
    await send(pb.LoadResponse(header=header))
    writer = ChunkWriter(
        stream, arena, model, packed_positions=request.packed_positions, by_position=request.shm_by_position,
    )  # fmt: skip
    try:
        while message := await asyncio.to_thread(writer.next_batch, *batches):
            await send(message)
    finally:
        writer.close()  # its views of the arena, before the arena may be unmapped


def load_trailer(stream: LoadStream) -> pb.LoadResponse:
    """The last answer of a Load: what the load delivered and what it read."""
    trailer = pb.LoadTrailer(
        num_tokens=stream.num_tokens,
        bytes_read=stream.bytes_read,
        read_amplification=stream.read_amplification,
        delivered_tokens=stream.delivered_tokens,
        delivered_fraction=stream.delivered_fraction,
        read_fraction=stream.read_fraction,
        estimated_coverage=stream.estimated_coverage,
    )
    return pb.LoadResponse(trailer=trailer)


async def send_lists(
    send: Send,
    store: SidecarStore,
    lists: np.ndarray[Any, Any],
    model: ModelSpec,
    namespace: str,
    arena: ServerArena | None,
) -> int:
    """Load each of `lists` from the root and write its reply, `many.LISTS_PER_HOP` lists per
    worker-thread hop; the bytes read. The KV goes into `arena` when there is one."""
    flat = None if arena is None else np.frombuffer(arena.buf, np.uint8)
    bytes_read = 0
    try:
        for start in range(0, len(lists), many.LISTS_PER_HOP):
            loaded = await asyncio.to_thread(many.load_lists, store, lists, start, model, namespace, flat)
            for reply, read in loaded:
                bytes_read += read
                await send(reply)
    finally:
        flat = None  # no view of the arena may outlive the call (nor a traceback's frame)
    return bytes_read
