"""Blocks in the layered layout: their records, how they are encoded and how a load joins them.

A layered block (docs/importance.md, "Layered layout") stores, by record index:

- 0 .. layers-1: the 2-bit key summary of layer L (kvstore/summary.py);
- layers + L * chunks_per_layer + c: chunk c of layer L, an ordinary chunk
  (kvstore/codec.py) with one layer and the `chunk_tokens` positions
  [c * chunk_tokens, (c + 1) * chunk_tokens) of the block, in prompt order.

A layer's chunks are adjacent on disk. The tiers store records by (block key,
layout version, index) and need not know which kind a record is. A normal
`load` selects units: chunk c of every layer, joined into one all-layer chunk.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvstore.codec import encode_chunk, reencode_raw
from kvstore.meta import BlockMeta
from kvstore.results import Array, LoadedChunk
from kvstore.summary import encode_summary, is_summary


def encode_layered(meta: BlockMeta, kv: Array, dtype: str, codec: str, zstd_level: int) -> list[bytes]:
    """Every record of a layered block, in record-index order.

    Args:
        meta: the block's metadata (layered; its `nbytes` is not read).
        kv: the block's KV in prompt order, (layers, 2, kv_heads, block_tokens, head_dim).
        dtype: the model's dtype name; codec and zstd_level: as kvstore.codec.encode_chunk.
    """
    records = [encode_summary(meta.chunk_id(layer), kv[layer, 0]) for layer in range(meta.num_layers)]
    c = meta.chunk_tokens
    for layer in range(meta.num_layers):
        for chunk in range(meta.chunks_per_layer):
            offsets = np.arange(chunk * c, (chunk + 1) * c, dtype=np.int64)
            cid = meta.chunk_id(meta.record_index(layer, chunk))
            part = kv[layer : layer + 1, :, :, chunk * c : (chunk + 1) * c]
            records.append(encode_chunk(cid, meta.start + offsets, part, dtype, codec, zstd_level))
    return records


def stored_records(meta: BlockMeta, units: Sequence[int]) -> list[int]:
    """Record indices a load of `units` reads: the units themselves, or for a layered block
    chunk u of every layer, unit by unit (layer order inside a unit)."""
    if not meta.is_layered:
        return list(units)
    return [meta.record_index(layer, u) for u in units for layer in range(meta.num_layers)]


def join_layers(
    meta: BlockMeta, block_index: int, units: Sequence[int], records: Sequence[LoadedChunk]
) -> list[LoadedChunk]:
    """One all-layer `LoadedChunk` per unit from its per-layer chunks (as `stored_records` ordered
    them); its tier is the slowest one a part came from."""
    layers = meta.num_layers
    joined = []
    for i, unit in enumerate(units):
        parts = records[i * layers : (i + 1) * layers]
        kv = np.concatenate([p.kv for p in parts], axis=0)
        tier = next((p.tier for p in parts if p.tier != "memory"), parts[0].tier)
        nbytes = sum(p.nbytes for p in parts)
        joined.append(LoadedChunk(block_index, unit, parts[0].positions, kv, tier, nbytes))
    return joined


def memory_record(data: bytes, dtype: str) -> bytes:
    """What the memory tier holds of a record: chunks uncompressed (no zstd on reads), summaries as is."""
    return data if is_summary(data) else reencode_raw(data, dtype)
