"""Load batches serialized by kvstore/server/batch_wire.py parse as the same LoadResponse
that protobuf itself would have built: inline KV, shared-memory refs, packed and
repeated positions, mixed in one batch, and a payload that is a strided view."""

from __future__ import annotations

import numpy as np

from kvstore._generated.kvsieve.v1 import kvsieve_pb2 as pb
from kvstore.server.batch_wire import encode_batch, serialize_load_response


def _chunk(index: int, shm_slot: int | None = None, packed: bool = True) -> pb.Chunk:
    chunk = pb.Chunk(block_index=index // 4, chunk_index=index % 4, tier="memory")
    positions = np.arange(index * 8, index * 8 + 8)
    if packed:
        chunk.positions_u32le = positions.astype("<u4").tobytes()
    else:
        chunk.positions.extend(positions.tolist())
    if shm_slot is not None:
        chunk.shm.slot, chunk.shm.num_tokens = shm_slot, 8
    return chunk


def test_encoded_batch_parses_as_the_protobuf_built_message() -> None:
    rng = np.random.default_rng(0)
    whole = rng.standard_normal((2, 2, 3, 64, 16)).astype(np.float16)
    payloads = [
        np.ascontiguousarray(whole[:, :, :, 0:8]),
        None,  # placed in shared memory
        whole[:, :, :, 16:24],  # a strided view: made contiguous on the way
        np.zeros((0,), np.float16),  # an empty payload still sets the field
        np.ascontiguousarray(whole[:, :, :, 40:48]),
    ]
    chunks = [_chunk(0), _chunk(1, shm_slot=8), _chunk(2, packed=False), _chunk(3), _chunk(4)]
    expected = pb.LoadResponse()
    for chunk, payload in zip(chunks, payloads, strict=True):
        built = expected.batch.chunks.add()
        built.CopyFrom(chunk)
        if payload is not None:
            built.data = np.ascontiguousarray(payload).tobytes()
    parsed = pb.LoadResponse.FromString(encode_batch(chunks, payloads))
    assert parsed == expected
    assert parsed.WhichOneof("part") == "batch"
    assert parsed.batch.chunks[2].data == whole[:, :, :, 16:24].tobytes()
    assert not parsed.batch.chunks[1].data and parsed.batch.chunks[1].shm.slot == 8


def test_a_payload_over_two_megabytes_gets_a_multi_byte_length() -> None:
    payload = np.arange(3 << 20, dtype=np.uint8).reshape(1, 1, 1, -1, 1)
    parsed = pb.LoadResponse.FromString(encode_batch([_chunk(0)], [payload]))
    assert parsed.batch.chunks[0].data == payload.tobytes()


def test_the_serializer_passes_encoded_batches_through_and_serializes_messages() -> None:
    encoded = encode_batch([_chunk(0)], [None])
    assert serialize_load_response(encoded) is encoded
    trailer = pb.LoadResponse(trailer=pb.LoadTrailer(num_tokens=7))
    assert serialize_load_response(trailer) == trailer.SerializeToString()


def test_bfloat16_and_empty_payloads_are_sent_byte_for_byte() -> None:
    """bfloat16 arrays export no buffer format and an empty view cannot be cast: both must
    still travel as their bytes (tobytes is the reference)."""
    import ml_dtypes

    bf16 = np.random.default_rng(1).standard_normal((2, 2, 1, 8, 4)).astype(ml_dtypes.bfloat16)
    empty = np.zeros((2, 2, 1, 0, 4), np.float16)
    parsed = pb.LoadResponse.FromString(encode_batch([_chunk(0), _chunk(1)], [bf16, empty]))
    assert parsed.batch.chunks[0].data == bf16.tobytes()
    assert parsed.batch.chunks[1].data == b""
