"""LookupMany and LoadMany: a batch of independent token lists in one call.

An engine that files each of its pages as its own root-level block (SGLang's HiCache
backend, docs/sglang.md) asks about, and loads, many of them at once. One Lookup or
Load per page costs a round trip and a stream each; these do the batch in one.
Each list is looked up and loaded from the root on its own, exactly as `Lookup` and
`Load` (budget 1.0) would, so they add no storage semantics of their own.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvstore._generated.kvsieve.v1 import kvsieve_pb2 as pb
from kvstore.errors import InvalidInputError
from kvstore.model import ModelSpec
from kvstore.rpc.messages import kv_bytes
from kvstore.server.backend import SidecarStore
from kvstore.server.limits import request_tokens

Array = np.ndarray[Any, Any]


def token_lists(request: Any, max_tokens: int) -> Array:
    """The request's lists as a (lists, list_tokens) uint32 array (no lists: shape (0, 1)).

    Raises:
        InvalidInputError: more than `max_tokens` tokens, or `list_tokens` does not cut them.
    """
    if not request.tokens_u32le:
        return np.empty((0, 1), np.uint32)
    tokens = request_tokens(request, max_tokens, "max_lookup_tokens")
    n = request.list_tokens
    if n == 0 or len(tokens) % n:
        raise InvalidInputError(f"list_tokens: {n} does not divide the {len(tokens)} tokens sent")
    return tokens.reshape(-1, n)


def leading_cached(store: SidecarStore, lists: Array, model: ModelSpec, namespace: str) -> int:
    """How many of `lists`, from the first, the store holds whole (reads no data): one walk of
    its index for all of them (`SidecarStore.lookup_many`), not a lookup per list."""
    return store.lookup_many(lists, model=model, namespace=namespace) if len(lists) else 0


# Lists loaded per worker-thread hop: a hop costs about as much as loading a small list.
LISTS_PER_HOP = 8


def load_lists(
    store: SidecarStore, lists: Array, start: int, model: ModelSpec, namespace: str, arena: Array | None
) -> list[tuple[pb.LoadManyResponse, int]]:
    """`load_list` of lists [start, start + LISTS_PER_HOP), in one worker-thread hop."""
    stop = min(start + LISTS_PER_HOP, len(lists))
    return [load_list(store, lists[i], i, model, namespace, arena) for i in range(start, stop)]


def load_list(
    store: SidecarStore, listed: Array, index: int, model: ModelSpec, namespace: str, arena: Array | None
) -> tuple[pb.LoadManyResponse, int]:
    """Load list `index` whole into its own array in the arena (`arena`: its bytes, uint8), or
    inline when there is none or it is too small: (its reply, encoded bytes read). A block
    lost on the way shortens `num_tokens`."""
    n = len(listed)
    size = n * model.token_bytes
    in_arena = arena is not None and (index + 1) * size <= len(arena)
    if in_arena and arena is not None:
        target = arena[index * size : (index + 1) * size].view(model.np_dtype).reshape(model.kv_shape(n))
    else:
        target = np.empty(model.kv_shape(n), model.np_dtype)
    with store.load(listed, model=model, namespace=namespace) as stream:
        for chunk in stream:
            _place(target, chunk.positions, chunk.kv)
        delivered, read = stream.num_tokens, stream.bytes_read
    if in_arena:
        return pb.LoadManyResponse(index=index, num_tokens=delivered, shm=True), read
    inline = kv_bytes(target[:, :, :, :delivered])
    return pb.LoadManyResponse(index=index, num_tokens=delivered, kv=inline), read


def _place(target: Array, positions: Array, kv: Array) -> None:
    """Write a chunk's tokens at the slots of their positions (a slice when they are a run)."""
    lo, hi = int(positions[0]), int(positions[-1])
    if hi - lo + 1 == len(positions) and bool(np.all(positions[1:] > positions[:-1])):
        target[:, :, :, lo : hi + 1] = kv
    else:
        target[:, :, :, positions] = kv
