"""Load responses carrying inline KV, serialized without protobuf's copy of the payload.

protobuf's `SerializeToString` of one batch of 16 SmolLM2 chunks (5.9 MB) took 8.3 ms
on the development machine, 710 MB/s: serializing on the server's event loop thread
was most of what a 47 MB gRPC Load cost (py-spy: the loop held the GIL 70 % of the
time, in serialization). Here each chunk's small fields are serialized by protobuf
and its KV is appended as the `data` field with its tag and length, so one
`b"".join` is the only copy of the payload. The result parses as the same
`LoadResponse` (protobuf accepts fields in any order; the field numbers are read
from the generated descriptors, so a renumbered field cannot go unnoticed).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvstore._generated.kvsieve.v1 import kvsieve_pb2 as pb

Array = np.ndarray[Any, Any]
_LENGTH_DELIMITED = 2


def _tag(field: Any) -> bytes:
    return _varint(field.number << 3 | _LENGTH_DELIMITED)


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


_BATCH_TAG = _tag(pb.LoadResponse.DESCRIPTOR.fields_by_name["batch"])
_CHUNKS_TAG = _tag(pb.ChunkBatch.DESCRIPTOR.fields_by_name["chunks"])
_DATA_TAG = _tag(pb.Chunk.DESCRIPTOR.fields_by_name["data"])


def encode_batch(chunks: Sequence[pb.Chunk], payloads: Sequence[Array | None]) -> bytes:
    """The serialized `LoadResponse(batch=ChunkBatch(chunks))`, each chunk's `data` set to
    the bytes of its payload (None: no data, as for a chunk placed in shared memory).

    The chunks must not have `data` set themselves.
    """
    pieces: list[bytes | memoryview] = []
    batch_len = 0
    for chunk, payload in zip(chunks, payloads, strict=True):
        small = chunk.SerializeToString()
        # Bytes of any dtype and size (bfloat16 exports no buffer format; a 0-byte view cannot be cast).
        data = None if payload is None else np.ascontiguousarray(payload).reshape(-1).view(np.uint8).data
        data_head = b"" if data is None else _DATA_TAG + _varint(len(data))
        chunk_len = len(small) + len(data_head) + (0 if data is None else len(data))
        head = _CHUNKS_TAG + _varint(chunk_len)
        pieces += [head, small, data_head]
        if data is not None:
            pieces.append(data)
        batch_len += len(head) + chunk_len
    return b"".join([_BATCH_TAG, _varint(batch_len), *pieces])


def serialize_load_response(message: pb.LoadResponse | bytes) -> bytes:
    """The Load method's response serializer: batches arrive already encoded."""
    return message if isinstance(message, bytes) else message.SerializeToString()
