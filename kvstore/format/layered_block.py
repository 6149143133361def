"""Blocks in the layered layout: which records a block has, and how they are encoded.

A layered block (docs/importance.md, "Layered layout") stores, by record index:

- 0 .. layers-1: the 2-bit key summary of layer L (kvstore/format/key_summary.py);
- layers + L: the layer record of layer L (kvstore/format/layer_record.py): all its chunks of
  `chunk_tokens` positions, in prompt order, each one addressable by byte range.

A packed block (layout v3, what stores write; `BlockMeta.is_packed`) stores its layer records
in one value instead, the layer pack at index `layers` (kvstore/format/layer_pack.py); each
record inside keeps its identity (index layers + L). Version 2 blocks, a value per layer
record, stay readable.

The tiers store records by (block key, layout version, index) and need not know which
kind a record is. How a load reads them is kvstore/load/read_layered.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import xxhash

from kvstore.format.block_meta import BlockMeta
from kvstore.format.chunk import reencode_raw
from kvstore.format.key_summary import SummaryGeometry, encode_summaries, is_summary
from kvstore.format.layer_pack import (
    encode_pack,
    encode_pack_parts,
    encode_raw_pack,
    is_pack,
    parse_table,
    split_pack,
)
from kvstore.format.layer_record import (
    LayerGeometry,
    LayerHeader,
    decode_layer_record,
    is_layer_record,
    layer_record_parts,
    raw_layer_record,
)
from kvstore.model import ModelSpec
from kvstore.values import Array


def encode_layered(
    meta: BlockMeta, kv: Array, dtype: str, codec: str, zstd_level: int
) -> list[bytes | memoryview]:
    """Every record of a layered block, in record-index order (a packed block's layer records
    in one pack). A raw pack is a read-only memoryview of a buffer of its own (the one copy of the
    KV, kvstore/format/layer_pack.py `encode_raw_pack`); every other record is bytes.

    Args:
        meta: the block's metadata (layered; its `nbytes` is not read).
        kv: the block's KV in prompt order, (layers, 2, kv_heads, block_tokens, head_dim).
        dtype: the model's dtype name; codec and zstd_level: as kvstore.format.chunk.encode_chunk.
    """
    records = encode_summaries([meta.chunk_id(layer) for layer in range(meta.num_layers)], kv[:, 0])
    return [*records, *encode_layer_part(meta, kv, dtype, codec, zstd_level)]


def encode_layer_part(
    meta: BlockMeta, kv: Array, dtype: str, codec: str, zstd_level: int
) -> list[bytes | memoryview]:
    """The records of a layered block after its summaries (what a full load reads): the pack of a
    packed block (a raw one a read-only memoryview, made with one copy), else one layer record per
    layer. Arguments as `encode_layered`."""
    ids = [meta.chunk_id(meta.record_index(layer, 0)) for layer in range(meta.num_layers)]
    if meta.is_packed and codec == "raw":
        return [encode_raw_pack(meta.chunk_id(meta.pack_index), ids, kv, dtype, meta.chunk_tokens)]
    layers = [
        layer_record_parts(rid, kv[layer], dtype, meta.chunk_tokens, codec, zstd_level)
        for layer, rid in enumerate(ids)
    ]
    if meta.is_packed:  # the parts joined once, into the pack
        return [encode_pack_parts(meta.chunk_id(meta.pack_index), layers)]
    return [b"".join(parts) for parts in layers]


def layer_geometry(meta: BlockMeta, layer: int, model: ModelSpec) -> LayerGeometry:
    """What the layer record of `layer` must describe: the block's chunk size and count, its record
    index, and the model's dtype, kv heads and head dim (its header is never trusted about them)."""
    return LayerGeometry(
        meta.record_index(layer, 0), meta.chunk_tokens, meta.chunks_per_layer, model.dtype,
        model.num_kv_heads, model.head_dim,
    )  # fmt: skip


def summary_geometry(meta: BlockMeta, model: ModelSpec) -> SummaryGeometry:
    """What every key summary of the block must describe: its tokens, the model's kv heads and head dim."""
    return SummaryGeometry(meta.num_tokens, model.num_kv_heads, model.head_dim)


def stored_records(meta: BlockMeta, units: Sequence[int]) -> list[int]:
    """Record indices a load of `units` reads: the units themselves, or for a layered block
    every layer record (a unit is one chunk of every layer), or its pack."""
    if not meta.is_layered:
        return list(units)
    if meta.is_packed:
        return [meta.pack_index] if units else []
    return [meta.record_index(layer, 0) for layer in range(meta.num_layers)] if units else []


def keys_of_block(meta: BlockMeta, records: Sequence[bytes | memoryview], model: ModelSpec) -> Array:
    """A layered block's keys, (layers, kv_heads, tokens, head_dim) in the model's dtype, taken back
    from its own layer records (`records` in record-index order, as `encode_layered` makes them; the
    summary slots are not read). For summaries encoded after the Store (kvstore/store/deferred.py):
    the records are immutable bytes this process wrote, so nothing of the caller's is kept."""
    if meta.is_packed:
        pack = records[meta.pack_index]
        parts: Sequence[bytes | memoryview] = split_pack(
            pack, parse_table(pack, meta.chunk_id(meta.pack_index), meta.num_layers)
        )
    else:
        parts = [records[meta.record_index(layer, 0)] for layer in range(meta.num_layers)]
    shape = (meta.num_layers, model.num_kv_heads, meta.num_tokens, model.head_dim)
    keys = np.empty(shape, model.np_dtype)
    for layer, part in enumerate(parts):
        index = meta.record_index(layer, 0)
        _, chunks = decode_layer_record(
            part, meta.chunk_id(index), trusted=True, geometry=layer_geometry(meta, layer, model)
        )
        n, _, heads, c, dim = chunks.shape  # chunk-major: (chunks, k/v, heads, chunk tokens, dim)
        keys[layer].reshape(heads, n, c, dim)[...] = chunks[:, 0].transpose(1, 0, 2, 3)
    return keys


def memory_record(data: bytes | memoryview, dtype: str, meta: BlockMeta | None = None) -> bytes | memoryview:
    """What the memory tier holds of a record: chunks uncompressed (no zstd on reads), summaries as
    is. A pack needs its block's `meta` (its table is verified against it)."""
    if is_summary(data):
        return data
    if is_pack(data):
        if meta is None:
            raise ValueError("a layer pack's memory record needs its block's metadata")
        return raw_pack(meta, data)
    return raw_layer_record(data) if is_layer_record(data) else reencode_raw(data, dtype)


def raw_pack(meta: BlockMeta, data: bytes | memoryview) -> bytes:
    """The pack `data` of block `meta` with every layer record uncompressed (the same bytes if raw)."""
    parts = split_pack(data, parse_table(data, meta.chunk_id(meta.pack_index), meta.num_layers))
    raws = [raw_layer_record(part) for part in parts]
    if all(len(r) == len(p) for r, p in zip(raws, parts, strict=True)):
        return bytes(data)
    return encode_pack(meta.chunk_id(meta.pack_index), raws)


def chunks_match(header: LayerHeader, chunks: Sequence[int], stored: Sequence[Any]) -> bool:
    """Whether each chunk `chunks[i]` of the layer record `header` describes has the stored bytes
    `stored[i]` (any buffer), by its xxh3-64 in the header's table (a chunk read by offset)."""
    sums, digest = header.checksums, xxhash.xxh3_64_intdigest
    return all(digest(data) == sums[c] for c, data in zip(chunks, stored, strict=True))
