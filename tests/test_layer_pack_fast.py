"""The one-copy raw layer pack (kvstore/format/layer_pack.py `encode_raw_pack`) and `encode_layered`:
byte for byte what the parts built (`layer_record_parts` joined by `encode_pack_parts`, or by
b"".join for v2 blocks), for every codec, dtype and block kind a store writes, from KV of any
strides; and what a tier is given of a raw pack (a read-only view the memory tier keeps uncopied).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from kvstore.errors import InvalidInputError
from kvstore.format.block_meta import LAYERED, BlockMeta, layered_layout_version
from kvstore.format.chunk import ChunkId
from kvstore.format.key_summary import encode_summaries
from kvstore.format.layer_pack import encode_pack_parts, encode_raw_pack, parse_table, split_pack
from kvstore.format.layer_record import decode_layer_record, layer_record_parts
from kvstore.format.layered_block import encode_layered
from kvstore.model import numpy_dtype
from kvstore.tiers.pinned import host_buffer

Array = np.ndarray[Any, Any]
LAYERS, HEADS, DIM, B = 3, 2, 8, 32  # B: block tokens
DTYPES = ["float16", "bfloat16", "float32"]
PACK_ID = ChunkId(b"f" * 16, b"n" * 16, b"k" * 16, 0xC000_0008, LAYERS)


def _prefix(dtype: str, blocks: int = 3, layers: int = LAYERS, seed: int = 0) -> Array:
    """A prefix's KV, (layers, 2, heads, blocks * B, dim): a block of it is a strided slice."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal((layers, 2, HEADS, blocks * B, DIM)).astype(numpy_dtype(dtype))


def _meta(chunk_tokens: int, packed: bool, layers: int = LAYERS) -> BlockMeta:
    return BlockMeta(
        b"k" * 16, b"p" * 16, b"f" * 16, b"n" * 16, 1, np.arange(B, dtype=np.uint32), chunk_tokens,
        layered_layout_version(chunk_tokens, packed), np.arange(B, dtype=np.int64), None, 0, 0.0,
        "default", LAYERED, layers,
    )  # fmt: skip


def _ids(layers: int = LAYERS) -> list[ChunkId]:
    return [replace(PACK_ID, chunk_index=layers + layer) for layer in range(layers)]


def _reference_pack(
    ids: list[ChunkId], kv: Array, dtype: str, chunk_tokens: int, codec: str = "raw"
) -> bytes:
    parts = [layer_record_parts(rid, kv[i], dtype, chunk_tokens, codec) for i, rid in enumerate(ids)]
    return encode_pack_parts(replace(PACK_ID, chunk_index=len(ids)), parts)


def _reference_layered(meta: BlockMeta, kv: Array, dtype: str, codec: str) -> list[bytes]:
    """What `encode_layered` returned before the one-copy pack: the parts, joined."""
    records = encode_summaries([meta.chunk_id(layer) for layer in range(meta.num_layers)], kv[:, 0])
    ids = [meta.chunk_id(meta.record_index(layer, 0)) for layer in range(meta.num_layers)]
    layers = [layer_record_parts(rid, kv[i], dtype, meta.chunk_tokens, codec) for i, rid in enumerate(ids)]
    if meta.is_packed:
        return [*records, encode_pack_parts(meta.chunk_id(meta.pack_index), layers)]
    return [*records, *(b"".join(parts) for parts in layers)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("codec", ["raw", "shuffle-zstd"])
@pytest.mark.parametrize("packed", [True, False], ids=["v3-packed", "v2"])
@pytest.mark.parametrize("chunk_tokens", [8, B], ids=["4-chunks", "1-chunk"])
def test_encode_layered_writes_the_bytes_the_parts_did(
    dtype: str, codec: str, packed: bool, chunk_tokens: int
) -> None:
    kv = _prefix(dtype)[:, :, :, B : 2 * B]  # a block of a longer prefix, as kvstore/store/write.py passes
    assert not kv.flags.c_contiguous
    meta = _meta(chunk_tokens, packed)
    got = encode_layered(meta, kv, dtype, codec, 1)
    want = _reference_layered(meta, kv, dtype, codec)
    assert [bytes(r) for r in got] == want
    assert [len(r) for r in got] == [len(r) for r in want]  # what stores count as a block's bytes
    if packed and codec == "raw":
        assert isinstance(got[-1], memoryview) and got[-1].readonly
    else:
        assert all(isinstance(r, bytes) for r in got)


def _strided(dtype: str) -> dict[str, Array]:
    """A block's KV laid out every way a caller may hand it over."""
    prefix = _prefix(dtype)
    block = prefix[:, :, :, B : 2 * B]
    return {
        "prefix-slice": block,
        "contiguous": np.ascontiguousarray(block),
        "reversed-dim": prefix[:, :, :, B : 2 * B, ::-1],  # no axis contiguous
        "fortran": np.asfortranarray(block),
        "every-other-token": _prefix(dtype, blocks=6)[:, :, :, ::2][:, :, :, B : 2 * B],
        "one-layer": block[:1],
    }


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "layout", ["prefix-slice", "contiguous", "reversed-dim", "fortran", "every-other-token", "one-layer"]
)
@pytest.mark.parametrize("chunk_tokens", [1, 8, B], ids=["1-token-chunks", "4-chunks", "1-chunk"])
def test_the_raw_pack_is_the_parts_pack_from_any_strides(dtype: str, layout: str, chunk_tokens: int) -> None:
    kv = _strided(dtype)[layout]
    ids = _ids(kv.shape[0])
    pack = encode_raw_pack(replace(PACK_ID, chunk_index=len(ids)), ids, kv, dtype, chunk_tokens)
    assert bytes(pack) == _reference_pack(ids, kv, dtype, chunk_tokens)
    table = parse_table(pack, replace(PACK_ID, chunk_index=len(ids)), len(ids))
    for layer, record in enumerate(split_pack(pack, table)):  # and it reads back as that KV
        _, chunks = decode_layer_record(record, ids[layer])
        n, _, heads, c, dim = chunks.shape
        got = chunks.transpose(1, 2, 0, 3, 4).reshape(2, heads, n * c, dim)
        assert got.tobytes() == np.ascontiguousarray(kv[layer]).tobytes()


def test_a_raw_pack_is_a_read_only_view_the_memory_tier_keeps_without_a_copy() -> None:
    kv = _prefix("float16")[:, :, :, :B]
    pack = encode_raw_pack(replace(PACK_ID, chunk_index=LAYERS), _ids(), kv, "float16", 8)
    assert isinstance(pack, memoryview) and pack.readonly and pack.format == "B" and pack.ndim == 1
    assert len(pack) == pack.nbytes
    held = host_buffer(pack, pinned=False)  # kvstore/tiers/memory.py without an arena
    assert np.shares_memory(held, np.frombuffer(pack, np.uint8)) and not held.flags.writeable
    with pytest.raises(TypeError):
        pack[0] = 1


@pytest.mark.parametrize(
    ("shape", "chunk_tokens", "layers"),
    [((LAYERS, 2, HEADS, B, DIM), 5, LAYERS), ((LAYERS, 3, HEADS, B, DIM), 8, LAYERS),
     ((LAYERS, 2, HEADS, B, DIM), 8, LAYERS - 1), ((2, HEADS, B, DIM), 8, 2),
     ((0, 2, HEADS, B, DIM), 8, 0)],
)  # fmt: skip
def test_the_raw_pack_refuses_what_the_parts_refuse(
    shape: tuple[int, ...], chunk_tokens: int, layers: int
) -> None:
    with pytest.raises(InvalidInputError):
        encode_raw_pack(
            replace(PACK_ID, chunk_index=layers),
            _ids(layers),
            np.zeros(shape, np.float16),
            "float16",
            chunk_tokens,
        )
