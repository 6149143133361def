"""Chunk encode and decode: one 16-token chunk, raw and shuffle-zstd, two model shapes.

Random fp16 KV compresses less than real KV does, so the zstd figures are an upper
bound on the time spent per byte in, not a measure of the ratio.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvstore.format.chunk import ChunkId, decode_chunk, encode_chunk
from kvstore.model import ModelSpec

CHUNK_TOKENS = 16
SHAPES = {
    "smollm2": ModelSpec("micro-smollm2", num_layers=30, num_kv_heads=3, head_dim=64),
    "dim4096": ModelSpec("micro-dim4096", num_layers=32, num_kv_heads=8, head_dim=128),
}
CHUNK_ID = ChunkId(bytes(16), bytes(16), bytes(16), 1, 0)


@pytest.fixture(scope="module", params=list(SHAPES))
def chunk(request: pytest.FixtureRequest) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """(positions, kv) of one chunk of the shape named by the parameter."""
    rng = np.random.default_rng(0)
    kv = rng.standard_normal(SHAPES[request.param].kv_shape(CHUNK_TOKENS)).astype(np.float16)
    return np.arange(CHUNK_TOKENS), kv


@pytest.mark.parametrize("codec", ["raw", "shuffle-zstd"])
def test_encode(benchmark: Any, chunk: tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]], codec: str) -> None:
    positions, kv = chunk
    data = benchmark(encode_chunk, CHUNK_ID, positions, kv, "float16", codec)
    assert decode_chunk(data, expect=CHUNK_ID).kv.tobytes() == kv.tobytes()


@pytest.mark.parametrize("codec", ["raw", "shuffle-zstd"])
def test_decode(benchmark: Any, chunk: tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]], codec: str) -> None:
    positions, kv = chunk
    data = encode_chunk(CHUNK_ID, positions, kv, "float16", codec)
    decoded = benchmark(decode_chunk, data, CHUNK_ID)
    assert np.array_equal(decoded.kv, kv)
