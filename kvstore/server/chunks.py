"""Moving KV between messages and arrays on the server: chunks out (inline or into a
client's arena), slices in."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import numpy as np

from kvstore._generated.kvsieve.v1 import kvsieve_pb2 as pb
from kvstore.api import LoadStream
from kvstore.errors import InvalidInputError
from kvstore.load.assemble import Array, Copy, run_copies
from kvstore.model import ModelSpec
from kvstore.rpc.messages import kv_from_bytes
from kvstore.rpc.shm import ServerArena, dense_view
from kvstore.server.backend import PlacingStream
from kvstore.server.batch_wire import encode_batch
from kvstore.server.limits import within
from kvstore.values import LoadedChunk


class ChunkWriter:
    """Turns loaded chunks into messages in a worker thread, into shm when there is room."""

    def __init__(
        self, stream: LoadStream, arena: ServerArena | None, model: ModelSpec, *,
        packed_positions: bool = False, by_position: bool = False,
    ) -> None:  # fmt: skip
        self._chunks: Iterator[LoadedChunk] = iter(stream)
        self._packed = packed_positions  # the client reads positions_u32le
        self._dense = None if arena is None else dense_view(arena.buf, model)
        self._slot = 0
        self._copies: list[Copy] = []
        self._payloads: list[Array | None] = []
        # Slot = position: the client gets the prefix in position order, no reorder copy.
        self.by_position = by_position and self._dense is not None
        # Whole blocks copied straight into the arena, each byte once (kvstore/load/place.py)
        self._placed = None
        if self.by_position and self._dense is not None and isinstance(stream, PlacingStream):
            self._placed = stream.place_into(self._dense)

    def close(self) -> None:
        """Drop every view of the arena, so it can be unmapped the moment the load ends (an
        ended call's frames may outlive it, in a traceback grpc keeps). Idempotent."""
        self._dense, self._copies, self._payloads = None, [], []
        self._chunks, self._placed = iter(()), None

    def next_batch(self, max_chunks: int, max_bytes: int, max_shm_chunks: int = 0) -> bytes | None:
        """One serialized `LoadResponse` batch with up to `max_chunks` inline chunks and about
        `max_bytes` inline bytes, or up to `max_shm_chunks` (default `max_chunks`) chunks in
        all when they went to shm (kvstore/server/batch_wire.py serializes it)."""
        if self._placed is not None:
            return self._placed_batch(max(max_chunks, max_shm_chunks))
        response = pb.LoadResponse()
        batch = response.batch
        inline = inline_chunks = 0
        self._copies = []  # into the arena, after the batch is read: two threads
        self._payloads = []  # inline KV, appended when serialized
        for chunk in self._chunks:
            placed = self._fill(batch.chunks.add(), chunk)  # in place: no sub-message copy
            inline, inline_chunks = inline + placed, inline_chunks + bool(placed)
            if (
                inline_chunks == max_chunks
                or inline >= max_bytes
                or len(batch.chunks) == max(max_chunks, max_shm_chunks)
            ):
                break
        run_copies(self._copies)
        return encode_batch(batch.chunks, self._payloads) if len(batch.chunks) else None

    def _placed_batch(self, max_blocks: int) -> bytes | None:
        """A batch of up to `max_blocks` whole blocks copied into the arena, one chunk message each
        (its slots are its positions), each sent only once its block is there and verified."""
        assert self._placed is not None
        response = pb.LoadResponse()
        chunks = response.batch.chunks
        for placed in self._placed:
            message = chunks.add()
            message.block_index, message.tier = placed.block_index, placed.tier
            if self._packed:
                message.positions_u32le = placed.positions.astype("<u4").tobytes()
            else:
                message.positions.extend(placed.positions.tolist())
            message.shm.slot, message.shm.num_tokens = int(placed.positions[0]), len(placed.positions)
            if len(chunks) == max_blocks:
                break
        return response.SerializeToString() if len(chunks) else None

    def _fill(self, message: pb.Chunk, chunk: LoadedChunk) -> int:
        """Fill `message`; returns the bytes placed inline (0 when they went to shm)."""
        message.block_index, message.chunk_index, message.tier = (
            chunk.block_index,
            chunk.chunk_index,
            chunk.tier,
        )
        if self._packed:
            message.positions_u32le = chunk.positions.astype("<u4").tobytes()
        else:
            message.positions.extend(chunk.positions.tolist())
        n = len(chunk.positions)
        if self.by_position:
            return self._place_by_position(message, chunk)
        if self._dense is not None and self._slot + n <= self._dense.shape[3]:
            self._copies.append((self._dense, slice(self._slot, self._slot + n), chunk.kv))
            message.shm.slot, message.shm.num_tokens = self._slot, n
            self._slot += n
            self._payloads.append(None)
            return 0
        self._payloads.append(chunk.kv)
        return int(chunk.kv.nbytes)

    def _place_by_position(self, message: pb.Chunk, chunk: LoadedChunk) -> int:
        """Write the chunk's tokens at the slots of their positions (inline if beyond the arena)."""
        assert self._dense is not None
        positions = chunk.positions
        lo, hi = int(positions.min()), int(positions.max())
        if hi >= self._dense.shape[3]:
            self._payloads.append(chunk.kv)
            return int(chunk.kv.nbytes)
        if hi - lo + 1 == len(positions) and bool(np.all(positions[1:] > positions[:-1])):
            self._copies.append((self._dense, slice(lo, hi + 1), chunk.kv))  # a run: a slice
        else:
            self._copies.append((self._dense, positions, chunk.kv))
        message.shm.slot, message.shm.num_tokens = lo, len(positions)
        self._payloads.append(None)
        return 0


def place_slice(kv: np.ndarray[Any, Any], part: pb.KVSlice, filled: int, kv_start: int, model: Any) -> int:
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


async def receive_slices(
    requests: AsyncIterator[pb.StoreRequest], model: ModelSpec, shape: tuple[int, ...], kv_start: int,
    idle_s: float,
) -> Any:  # fmt: skip
    """The KV a Store stream sends as slices after its header, checked to cover every token.

    A client that sends nothing for `idle_s` seconds loses the stream (LimitExceededError), so a
    stalled Store cannot keep its reservation of in-flight bytes.
    """
    kv = np.empty(shape, model.np_dtype)  # untouched (no page is faulted) if one slice is all
    filled = 0
    refusal = f"Store: no slice for {idle_s:g} s (stream_idle_s); nothing was stored"
    while (message := await within(anext(requests, None), idle_s, refusal)) is not None:
        if message.WhichOneof("part") != "slice":
            raise InvalidInputError("after the header, a Store stream carries only slices")
        part = message.slice
        if filled == 0 and part.start_token == kv_start and part.num_tokens == shape[3]:
            # The whole KV in one slice (a client's slices are as large as a message may be): a
            # read-only view of the message's bytes, not a copy of them; the Store encodes it.
            kv = kv_from_bytes(part.data, model, part.num_tokens, "slice.data")
            filled = part.num_tokens
            continue
        filled = place_slice(kv, part, filled, kv_start, model)
    if filled != kv.shape[3]:
        raise InvalidInputError(f"slices cover {filled} of {kv.shape[3]} tokens; nothing was stored")
    return kv
