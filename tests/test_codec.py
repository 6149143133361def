"""Chunk codec: bit-exact round trips, and corruption never returns data."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.errors import ChecksumError, InvalidInputError
from kvstore.format.chunk import ChunkId, decode_chunk, encode_chunk, read_chunk_id
from kvstore.model import numpy_dtype

CID = ChunkId(b"f" * 16, b"n" * 16, b"k" * 16, 3, 7)


def _kv(dtype: str, shape: tuple[int, ...], seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    # Random bit patterns, NaNs and infinities included: the codec must not care.
    bits = rng.integers(0, 2**8, size=int(np.prod(shape)) * numpy_dtype(dtype).itemsize, dtype=np.uint8)
    return bits.view(numpy_dtype(dtype)).reshape(shape)


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from(["float16", "bfloat16", "float32"]),
    codec=st.sampled_from(["raw", "shuffle-zstd"]),
    layers=st.integers(1, 3),
    heads=st.integers(1, 3),
    tokens=st.integers(1, 17),
    dim=st.integers(1, 9),
    seed=st.integers(0, 2**31),
)
def test_round_trip_is_bit_exact(
    dtype: str, codec: str, layers: int, heads: int, tokens: int, dim: int, seed: int
) -> None:
    kv = _kv(dtype, (layers, 2, heads, tokens, dim), seed)
    positions = np.arange(100, 100 + tokens)
    data = encode_chunk(CID, positions, kv, dtype, codec)
    out = decode_chunk(data, CID)
    assert out.kv.dtype == kv.dtype and out.kv.shape == kv.shape
    assert out.kv.tobytes() == kv.tobytes()
    assert out.positions.tolist() == positions.tolist()
    assert out.codec == codec and out.chunk_id == CID


def test_shuffle_zstd_compresses_smooth_fp16() -> None:
    kv = (np.random.default_rng(0).standard_normal((4, 2, 3, 16, 64)) * 0.1).astype(np.float16)
    raw = encode_chunk(CID, np.arange(16), kv, "float16", "raw")
    packed = encode_chunk(CID, np.arange(16), kv, "float16", "shuffle-zstd")
    assert len(packed) < len(raw) / 1.05


@pytest.mark.parametrize("codec", ["raw", "shuffle-zstd"])
def test_every_flipped_byte_is_detected(codec: str) -> None:
    kv = _kv("float16", (1, 2, 1, 4, 4), 1)
    data = bytearray(encode_chunk(CID, np.arange(4), kv, "float16", codec))
    for offset in range(0, len(data), 7):
        corrupt = bytearray(data)
        corrupt[offset] ^= 0x40
        with pytest.raises(ChecksumError):
            decode_chunk(bytes(corrupt), CID)


def test_truncated_chunk_is_rejected() -> None:
    data = encode_chunk(CID, np.arange(4), _kv("float16", (1, 2, 1, 4, 4), 2), "float16")
    for cut in (0, 10, len(data) - 1):
        with pytest.raises(ChecksumError):
            decode_chunk(data[:cut], CID)


def test_identity_mismatch_is_rejected() -> None:
    data = encode_chunk(CID, np.arange(4), _kv("float16", (1, 2, 1, 4, 4), 3), "float16")
    other = ChunkId(CID.fingerprint, CID.namespace, CID.block_key, CID.layout_version, 8)
    with pytest.raises(ChecksumError, match="identity"):
        decode_chunk(data, other)
    assert read_chunk_id(data) == CID


def test_raw_decode_is_read_only_view() -> None:
    data = encode_chunk(CID, np.arange(4), _kv("float16", (1, 2, 1, 4, 4), 4), "float16")
    out = decode_chunk(data, CID)
    assert not out.kv.flags.writeable


def test_mutable_input_is_copied() -> None:
    kv = _kv("float16", (1, 2, 1, 4, 4), 5)
    data = bytearray(encode_chunk(CID, np.arange(4), kv, "float16"))
    out = decode_chunk(data, CID)
    data[:] = bytes(len(data))
    assert out.kv.tobytes() == kv.tobytes()


def test_bad_arguments() -> None:
    kv = _kv("float16", (1, 2, 1, 4, 4), 6)
    with pytest.raises(InvalidInputError, match="codec"):
        encode_chunk(CID, np.arange(4), kv, "float16", "lz4")
    with pytest.raises(InvalidInputError, match="positions"):
        encode_chunk(CID, np.arange(3), kv, "float16")
    with pytest.raises(InvalidInputError, match="shape"):
        encode_chunk(CID, np.arange(4), kv[0], "float16")


def test_every_codec_a_store_may_be_configured_with_has_an_id_on_disk() -> None:
    from kvstore.config import CODECS
    from kvstore.format.chunk import CODEC_IDS

    assert set(CODEC_IDS) == set(CODECS)
    assert len(set(CODEC_IDS.values())) == len(CODEC_IDS)
