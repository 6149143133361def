"""Layer records (kvstore/format/layer_record.py): round trips, ranged decodes, every bad record."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvstore.errors import ChecksumError, InvalidInputError
from kvstore.format.chunk import ChunkId
from kvstore.format.layer_record import (
    decode_layer_record,
    decode_run,
    encode_layer_record,
    header_bytes,
    parse_header,
    raw_layer_record,
)

CID = ChunkId(b"f" * 16, b"n" * 16, b"k" * 16, 3, 7)
HEADS, TOKENS, DIM, C = 3, 64, 8, 8
Array = np.ndarray[Any, Any]


def _kv(seed: int = 0) -> Array:
    return np.random.default_rng(seed).standard_normal((2, HEADS, TOKENS, DIM)).astype(np.float16)


def _chunk(kv: Array, c: int) -> Array:
    return kv[:, :, c * C : (c + 1) * C]


@pytest.mark.parametrize("codec", ["raw", "shuffle-zstd"])
def test_round_trip_whole_and_by_ranges(codec: str) -> None:
    kv = _kv()
    data = encode_layer_record(CID, kv, "float16", C, codec)
    header, chunks = decode_layer_record(data, CID)
    assert (header.codec, header.num_chunks, header.record_id, header.dtype) == (
        codec,
        TOKENS // C,
        CID,
        np.float16,
    )
    assert header.total_bytes == len(data) and header.size == header_bytes(TOKENS // C)
    for c in range(TOKENS // C):
        np.testing.assert_array_equal(chunks[c], _chunk(kv, c))
    head = parse_header(data[: header_bytes(TOKENS // C)], CID)  # the header range alone suffices
    runs = head.ranges([1, 2, 3, 6])
    assert [r[2] for r in runs] == [[1, 2, 3], [6]]  # adjacent chunks merged into one range
    for start, end, members in runs:
        got = decode_run(head, data[start:end], members)
        for i, c in enumerate(members):
            np.testing.assert_array_equal(got[i], _chunk(kv, c))


def test_zstd_record_is_smaller_on_repetitive_kv_and_converts_to_raw() -> None:
    kv = np.zeros((2, HEADS, TOKENS, DIM), np.float16) + np.float16(0.5)
    packed = encode_layer_record(CID, kv, "float16", C, "shuffle-zstd")
    raw = raw_layer_record(packed)
    assert len(packed) < len(raw) == header_bytes(TOKENS // C) + kv.nbytes
    assert parse_header(raw).codec == "raw"
    np.testing.assert_array_equal(decode_layer_record(raw, CID)[1], decode_layer_record(packed, CID)[1])


@pytest.mark.parametrize("codec", ["raw", "shuffle-zstd"])
@pytest.mark.parametrize("where", ["magic", "header", "table", "header-checksum", "chunk", "last-byte"])
def test_a_flipped_byte_anywhere_is_a_checksum_error(codec: str, where: str) -> None:
    data = bytearray(encode_layer_record(CID, _kv(), "float16", C, codec))
    size = header_bytes(TOKENS // C)
    offset = {"magic": 0, "header": 30, "table": size - 20, "header-checksum": size - 1,
              "chunk": size + 5, "last-byte": len(data) - 1}[where]  # fmt: skip
    data[offset] ^= 0x10
    with pytest.raises(ChecksumError):
        decode_layer_record(bytes(data), CID)
    if where == "chunk":  # a ranged read of that chunk fails too; of another chunk, it does not
        header = parse_header(bytes(data), CID)
        (start, end, members), (start2, end2, members2) = header.ranges([0]) + header.ranges([3])
        with pytest.raises(ChecksumError, match="chunk 0 checksum mismatch"):
            decode_run(header, bytes(data[start:end]), members)
        decode_run(header, bytes(data[start2:end2]), members2)


def test_wrong_identity_truncation_and_wrong_lengths_are_refused() -> None:
    data = encode_layer_record(CID, _kv(), "float16", C)
    other = ChunkId(CID.fingerprint, CID.namespace, CID.block_key, CID.layout_version, 8)
    with pytest.raises(ChecksumError, match="identity mismatch"):
        decode_layer_record(data, other)
    for cut in (3, 40, header_bytes(TOKENS // C) - 1):
        with pytest.raises(ChecksumError):
            parse_header(data[:cut])
    with pytest.raises(ChecksumError, match="its header says"):
        decode_layer_record(data[:-1], CID)
    header = parse_header(data)
    start, end, members = header.ranges([2])[0]
    with pytest.raises(ChecksumError, match="expected"):
        decode_run(header, data[start : end - 1], members)


def test_bad_input_is_refused_by_name() -> None:
    with pytest.raises(InvalidInputError, match="codec must be one of"):
        encode_layer_record(CID, _kv(), "float16", C, "lz4")
    with pytest.raises(InvalidInputError, match=r"tokens a multiple of 7"):
        encode_layer_record(CID, _kv(), "float16", 7)
    with pytest.raises(InvalidInputError, match="layer kv must be"):
        encode_layer_record(CID, _kv()[0], "float16", C)
