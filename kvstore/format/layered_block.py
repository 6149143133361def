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
    ids = [meta.chunk_id(meta.record_index(layer, 0)) for layer in range(meta.num_layers)]
    if meta.is_packed and codec == "raw":
        return [*records, encode_raw_pack(meta.chunk_id(meta.pack_index), ids, kv, dtype, meta.chunk_tokens)]
    layers = [
        layer_record_parts(rid, kv[layer], dtype, meta.chunk_tokens, codec, zstd_level)
        for layer, rid in enumerate(ids)
    ]
    if meta.is_packed:  # the parts joined once, into the pack
        return [*records, encode_pack_parts(meta.chunk_id(meta.pack_index), layers)]
    return [*records, *(b"".join(parts) for parts in layers)]


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
