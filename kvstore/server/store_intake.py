"""What a Store brings in: its size checked before anything is allocated, its namespace's
quota, and its KV, sent as slices on the stream or written into the caller's arena.

The servicer authorises the call and reserves the in-flight bytes; the checks here run
before that reservation and the allocation it bounds, so a request over a limit costs
no memory.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np

from kvstore._generated.kvsieve.v1 import kvsieve_pb2 as pb
from kvstore.errors import InvalidInputError, LimitExceededError, NotFoundError
from kvstore.model import ModelSpec
from kvstore.server.arenas import ArenaCache, Owner
from kvstore.server.backend import SidecarStore
from kvstore.server.chunks import receive_slices
from kvstore.server.limits import within
from kvstore.server.tenants import namespace_usage


def store_bytes(model: ModelSpec, num_tokens: int, max_store_bytes: int) -> int:
    """Bytes of the KV of `num_tokens` tokens; InvalidInputError above `max_store_bytes`."""
    nbytes = num_tokens * model.token_bytes  # Python ints: no overflow, nothing allocated yet
    if nbytes > max_store_bytes:
        raise InvalidInputError(
            f"KV of {num_tokens} tokens at {model.token_bytes} B/token is {nbytes} B, above "
            f"max_store_bytes {max_store_bytes}"
        )
    return nbytes


async def check_namespace_bytes(store: SidecarStore, namespace: str, quota: int) -> None:
    """LimitExceededError if `namespace` already holds `quota` bytes (0: no quota)."""
    if not quota:
        return
    _, held = await asyncio.to_thread(namespace_usage, store, frozenset([namespace]))
    if held >= quota:
        raise LimitExceededError(
            f"namespace {namespace!r} holds {held} B, its quota namespace_max_bytes is {quota}"
        )


async def receive_kv(
    request_iterator: AsyncIterator[pb.StoreRequest],
    header: pb.StoreHeader,
    owner: Owner,
    model: ModelSpec,
    shape: tuple[int, ...],
    *,
    arenas: ArenaCache,
    shm: bool,
    idle_s: float,
) -> tuple[Any, Callable[[], None]]:
    """The Store's KV of `shape` and what releases it: a view of the arena the header names (then
    the stream must end; the arena stays held until the release), else received as slices; each
    wait on the client bounded by `idle_s`."""
    if not header.arena_id:
        kv = await receive_slices(request_iterator, model, shape, header.kv_start, idle_s)
        return kv, _nothing
    kv = await asyncio.to_thread(kv_from_arena, arenas, shm, header.arena_id, owner, model, shape)
    release = functools.partial(arenas.done, header.arena_id)
    try:
        refusal = f"Store: no end of stream for {idle_s:g} s (stream_idle_s)"
        if await within(anext(aiter(request_iterator), None), idle_s, refusal) is not None:
            raise InvalidInputError("a Store through an arena carries no slices")
    except BaseException:
        del kv
        release()
        raise
    return kv, release


def kv_from_arena(
    arenas: ArenaCache, shm: bool, arena_id: str, owner: Owner, model: ModelSpec, shape: tuple[int, ...]
) -> Any:
    """A Store's KV: a read-only view of the caller's arena, which stays acquired (busy: neither
    reused nor released) until the caller calls `arenas.done`.

    Not copied: the Store's one copy is its encoding (the layer pack, or the importance layout's
    chunks), into buffers of the store's own; every checksum and the deferred key summaries are
    computed from those, never from the arena. A client that writes its arena during its own Store
    can only make its own blocks hold other values than it meant, never a record whose checksum
    does not match its bytes. The arena is sealed against shrinking (no SIGBUS).
    """
    if not shm:
        raise NotFoundError("shared memory is disabled on this server: send the KV as slices")
    arena = arenas.acquire(arena_id, owner)  # PermissionDeniedError if not the caller's
    if arena is None:
        raise NotFoundError(f"arena {arena_id!r} is unknown or busy: send the KV as slices")
    try:
        count = int(np.prod(shape))
        if len(arena.buf) < count * model.itemsize:
            raise InvalidInputError(
                f"arena {arena_id!r} holds {len(arena.buf)} B, the KV needs {count * model.itemsize} B"
            )
        view = np.frombuffer(arena.buf, model.np_dtype, count).reshape(shape)
    except BaseException:
        arenas.done(arena_id)
        raise
    view.flags.writeable = False
    return view


def _nothing() -> None:
    """The release of KV received as slices (the Store's own array)."""
