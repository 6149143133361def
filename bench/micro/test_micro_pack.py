"""The layer pack of one 256-token block of SmolLM2's shape (30 layers x 3 KV heads x 64, fp16, 16-token
chunks: 5.9 MB of KV), raw: built from `layer_record_parts` joined by `encode_pack_parts` (what
`encode_layered` did) and by `encode_raw_pack` (one copy of the KV), side by side.

Each round encodes the next block of a 16-block prefix (94 MB, past a 32 MB L3: the KV comes from
memory, as a store's does), a strided slice as kvstore/store/write.py passes it.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest

from kvstore.format.chunk import ChunkId
from kvstore.format.layer_pack import encode_pack_parts, encode_raw_pack
from kvstore.format.layer_record import layer_record_parts

LAYERS, HEADS, DIM, BLOCK, CHUNK, BLOCKS = 30, 3, 64, 256, 16, 16
PACK_ID = ChunkId(bytes(16), bytes(16), bytes(16), 1, LAYERS)
IDS = [ChunkId(bytes(16), bytes(16), bytes(16), 1, LAYERS + layer) for layer in range(LAYERS)]


def _parts(kv: np.ndarray[Any, Any]) -> bytes:
    return encode_pack_parts(
        PACK_ID, [layer_record_parts(IDS[i], kv[i], "float16", CHUNK) for i in range(LAYERS)]
    )


def _one_copy(kv: np.ndarray[Any, Any]) -> memoryview:
    return encode_raw_pack(PACK_ID, IDS, kv, "float16", CHUNK)


@pytest.fixture(scope="module")
def prefix() -> np.ndarray[Any, Any]:
    """(layers, 2, heads, 16 blocks, dim) fp16."""
    return (
        np.random.default_rng(0).standard_normal((LAYERS, 2, HEADS, BLOCKS * BLOCK, DIM)).astype(np.float16)
    )


@pytest.mark.parametrize("how", ["parts", "one_copy"])
def test_encode_pack(benchmark: Any, prefix: np.ndarray[Any, Any], how: str) -> None:
    encode = {"parts": _parts, "one_copy": _one_copy}[how]
    blocks = itertools.cycle(range(BLOCKS))

    def next_block() -> tuple[tuple[np.ndarray[Any, Any]], dict[str, Any]]:
        b = next(blocks)
        return (prefix[:, :, :, b * BLOCK : (b + 1) * BLOCK],), {}

    benchmark.pedantic(encode, setup=next_block, rounds=64, warmup_rounds=4)
    first = prefix[:, :, :, :BLOCK]
    assert bytes(encode(first)) == _parts(first)
