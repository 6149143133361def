"""The layer pack of one 256-token block of SmolLM2's shape (30 layers x 3 KV heads x 64, fp16, 16-token
chunks: 5.9 MB of KV), raw: built from `layer_record_parts` joined by `encode_pack_parts` (what
`encode_layered` did) and by `encode_raw_pack` (one copy of the KV), side by side; and
`encode_layered` as a whole (the key summaries, then the pack) either way.

Each round encodes the next block of a 16-block prefix (94 MB, past a 32 MB L3: the KV comes from
memory, as a store's does), a strided slice as kvstore/store/write.py passes it.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest

from kvstore.format.block_meta import LAYERED, BlockMeta, layered_layout_version
from kvstore.format.key_summary import encode_summaries
from kvstore.format.layer_pack import encode_pack_parts, encode_raw_pack
from kvstore.format.layer_record import layer_record_parts
from kvstore.format.layered_block import encode_layered

LAYERS, HEADS, DIM, BLOCK, CHUNK, BLOCKS = 30, 3, 64, 256, 16, 16
META = BlockMeta(
    bytes(16), bytes(16), bytes(16), bytes(16), 0, np.arange(BLOCK, dtype=np.uint32), CHUNK,
    layered_layout_version(CHUNK), np.arange(BLOCK, dtype=np.int64), None, 0, 0.0, "default", LAYERED, LAYERS,
)  # fmt: skip
PACK_ID = META.chunk_id(META.pack_index)
IDS = [META.chunk_id(META.record_index(layer, 0)) for layer in range(LAYERS)]


def _parts(kv: np.ndarray[Any, Any]) -> bytes:
    return encode_pack_parts(
        PACK_ID, [layer_record_parts(IDS[i], kv[i], "float16", CHUNK) for i in range(LAYERS)]
    )


def _one_copy(kv: np.ndarray[Any, Any]) -> memoryview:
    return encode_raw_pack(PACK_ID, IDS, kv, "float16", CHUNK)


def _layered_parts(kv: np.ndarray[Any, Any]) -> list[bytes]:
    return [*encode_summaries([META.chunk_id(layer) for layer in range(LAYERS)], kv[:, 0]), _parts(kv)]


def _layered_one_copy(kv: np.ndarray[Any, Any]) -> list[bytes | memoryview]:
    return encode_layered(META, kv, "float16", "raw", 1)


ENCODE: dict[str, dict[str, Any]] = {
    "pack": {"parts": _parts, "one_copy": _one_copy},
    "layered": {"parts": _layered_parts, "one_copy": _layered_one_copy},
}


@pytest.fixture(scope="module")
def prefix() -> np.ndarray[Any, Any]:
    """(layers, 2, heads, 16 blocks, dim) fp16."""
    return (
        np.random.default_rng(0).standard_normal((LAYERS, 2, HEADS, BLOCKS * BLOCK, DIM)).astype(np.float16)
    )


@pytest.mark.parametrize("how", ["parts", "one_copy"])
@pytest.mark.parametrize("what", ["pack", "layered"])
def test_encode(benchmark: Any, prefix: np.ndarray[Any, Any], what: str, how: str) -> None:
    encode = ENCODE[what][how]
    blocks = itertools.cycle(range(BLOCKS))

    def next_block() -> tuple[tuple[np.ndarray[Any, Any]], dict[str, Any]]:
        b = next(blocks)
        return (prefix[:, :, :, b * BLOCK : (b + 1) * BLOCK],), {}

    benchmark.pedantic(encode, setup=next_block, rounds=64, warmup_rounds=4)
    first = prefix[:, :, :, :BLOCK]
    assert [bytes(r) for r in _layered_one_copy(first)] == _layered_parts(first)  # the same bytes
