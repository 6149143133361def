"""Full loads of packed layered blocks (layout v3): the whole pack, every layer in one copy.

A packed block's layer records lie in one value (kvstore/format/layer_pack.py). When a load
reads it whole (memory holds it, or every chunk is wanted), this module verifies every
record of it (a record memory holds: its header, parsed once and kept), promotes it to
memory in one piece, and copies the chosen chunks of all layers into the caller's
destination. Raw records of one block are all the same size, so the chunks of every layer
are one strided view of the pack, (layers, chunks, 2, kv_heads, chunk_tokens, head_dim): a
run of consecutive chunks is then one copy of every layer (two, one per copy thread),
where the per-layer path (kvstore/load/read_layered.py `load_units`) makes one per layer
and run, with a round of Python each. Partial loads of packs from a slower tier read
ranges there.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from kvstore.format.block_meta import BlockMeta
from kvstore.format.layer_pack import table_bytes
from kvstore.format.layer_record import LayerHeader, decode_layer_record, headers_like, parse_header
from kvstore.format.layered_block import layer_geometry
from kvstore.load.assemble import copy_pairs
from kvstore.load.fetch import Fetched, RecordFetcher, WholePack
from kvstore.load.read_layered import layer_units_view, loaded_units, runs_of, units_array
from kvstore.model import ModelSpec
from kvstore.values import Array, LoadedChunk


def load_pack_units(
    fetcher: RecordFetcher, meta: BlockMeta, block_index: int, units: Sequence[int], model: ModelSpec,
    into: Array | None = None,
) -> list[LoadedChunk] | None:  # fmt: skip
    """As kvstore/load/read_layered.py `load_units`, for a packed block read whole: all-layer
    `LoadedChunk`s, bit-exact (one per run of consecutive units when `into` is lent: a view of
    its tokens there), or None if no tier holds the pack.

    Raises:
        ChecksumError: a local pack or a record in it fails its checks (GeometryError: describes
            other geometry than `meta` and `model` imply).
    """
    if not units:
        return []
    pack = fetcher.whole_pack(meta, model)
    if pack is None:
        return None
    headers, layers = _verified_layers(fetcher, meta, pack, model)
    fetcher.promote_pack(meta, pack, headers, layers)
    order = np.asarray(units, dtype=np.int64)
    num_layers = meta.num_layers
    stacked = _stacked(pack, headers)
    out = units_array(into, num_layers, len(units), stacked[0] if stacked is not None else layers[0])
    dest = layer_units_view(out, into is out, num_layers, len(units))  # (layers, units, 2, heads, c, dim)
    copies: list[tuple[Array, Array]] = []
    half = num_layers // 2
    for first, chunk, count in runs_of(order):
        if stacked is not None:  # every layer at once, in two halves (the two copy threads)
            for part in (slice(0, half), slice(half, num_layers)):
                copies.append((dest[part, first : first + count], stacked[part, chunk : chunk + count]))
        else:
            for layer in range(num_layers):
                copies.append((dest[layer, first : first + count], layers[layer][chunk : chunk + count]))
    copy_pairs(copies)
    lengths = np.asarray([h.lengths for h in headers], np.int64)
    chosen = sorted(set(order.tolist()))
    if pack.trusted:  # a view of memory: only the table, the headers and the chosen chunks are read
        beside = table_bytes(num_layers) + sum(h.size for h in headers)
    else:
        beside = len(pack.data) - int(lengths[:, chosen].sum())
    return loaded_units(meta, block_index, order, out, into is out, lengths, beside, pack.tier, runs=True)


class PackView(NamedTuple):
    """A packed block's KV where it lies, for a copy to a device without a host copy first.

    Layer L's chunks, (chunks, 2, kv_heads, chunk_tokens, head_dim) in prompt order, are the
    `layer_bytes` bytes of `data` from `first + L * layer_stride`: one contiguous run per layer,
    and the runs of consecutive layers lie in one span of `data` (the layer headers between them).
    `data` is the memory tier's own record when the tier holds the pack (page-locked where CUDA
    is), else the bytes read from a slower tier; it stays valid while the view is held.
    """

    block_index: int
    positions: Array  # (chunks * chunk_tokens,) int64, ascending
    data: memoryview
    first: int
    layer_stride: int
    layer_bytes: int
    chunk_shape: tuple[int, int, int, int]  # (2, kv_heads, chunk_tokens, head_dim)
    dtype: np.dtype[Any]
    tier: str
    nbytes: int  # encoded bytes read from `tier` (the pack's)

    @property
    def num_chunks(self) -> int:
        """Chunks per layer."""
        return self.layer_bytes // (int(np.prod(self.chunk_shape)) * self.dtype.itemsize)

    def layer_span(self, first_layer: int, end_layer: int) -> tuple[int, int]:
        """(start, end) in `data` of the bytes that hold layers [first_layer, end_layer)."""
        start = self.first + first_layer * self.layer_stride
        return start, self.first + (end_layer - 1) * self.layer_stride + self.layer_bytes


def pack_view(fetcher: RecordFetcher, meta: BlockMeta, block_index: int, model: ModelSpec) -> PackView | None:
    """The whole pack of a packed block as a `PackView` (every chunk of every layer), verified and
    promoted to memory as `load_pack_units` does; None if no tier holds it. Viewed from memory once
    promoted: the one copy of a pack read from a slower tier is the promotion's, into the tier's
    own (page-locked) memory, from which the device copy is made. Records that are not raw ones of
    one size (compressed ones memory could not take) are decoded into one array instead.

    Raises:
        ChecksumError: as `load_pack_units`.
    """
    pack = fetcher.whole_pack(meta, model)
    return None if pack is None else view_of_pack(fetcher, meta, block_index, model, pack)


def view_of_pack(
    fetcher: RecordFetcher, meta: BlockMeta, block_index: int, model: ModelSpec, pack: WholePack
) -> PackView:
    """`pack_view` of a pack `RecordFetcher.whole_pack` read already (a reader thread's)."""
    headers, layers = _verified_layers(fetcher, meta, pack, model)
    fetcher.promote_pack(meta, pack, headers, layers)
    read = (pack.tier, len(pack.data))
    if not pack.trusted and (held := fetcher.held_pack(meta)) is not None:
        pack, headers, layers = held, fetcher.known_pack(meta) or headers, []
    positions = meta.start + np.arange(meta.chunks_per_layer * meta.chunk_tokens, dtype=np.int64)
    first = headers[0]
    if not layers and _stacked(pack, headers) is not None:
        return _view_in_place(meta, block_index, pack, headers, *read)
    # compressed records memory could not take, or raw ones of several sizes: one array of them
    joined = np.stack(layers) if layers else np.stack(_decoded(meta, pack, headers, model))
    return PackView(
        block_index, positions, memoryview(joined.reshape(-1).view(np.uint8).data), 0, joined[0].nbytes,
        joined[0].nbytes, first.chunk_shape(), first.dtype, *read,
    )  # fmt: skip


def held_view(fetcher: RecordFetcher, meta: BlockMeta, block_index: int, model: ModelSpec) -> PackView | None:
    """The pack memory holds of `meta` as a `PackView` of memory's own bytes: nothing is read from
    another tier and nothing counted (a partial load counts what it copies). None if memory does not
    hold it, or its records are not raw ones of one size (read those by ranges).

    Raises:
        ChecksumError: as `pack_view` (memory's headers are checked once, then kept).
    """
    pack = fetcher.memory_pack(meta)
    if pack is None:
        return None
    headers, layers = _verified_layers(fetcher, meta, pack, model)
    if layers or _stacked(pack, headers) is None:
        return None
    return _view_in_place(meta, block_index, pack, headers, pack.tier, 0)


def raw_pack_view(
    fetcher: RecordFetcher, meta: BlockMeta, block_index: int, model: ModelSpec, pack: WholePack
) -> PackView | None:
    """A pack of raw records of one size as a `PackView` of its own bytes, every header checked
    against the geometry `meta` and `model` imply: for a pack whose records' checksum the caller
    checks itself (one read in place, kvstore/load/place.py). Nothing is promoted, counted or
    decoded; None if its records are not raw ones of one size.

    Raises:
        ChecksumError: its first header fails its checks (GeometryError: of other geometry).
    """
    headers = _raw_headers_at_once(fetcher, meta, pack, model)
    if headers is None:
        return None
    return _view_in_place(meta, block_index, pack, headers, pack.tier, len(pack.data))


def _view_in_place(
    meta: BlockMeta, block_index: int, pack: WholePack, headers: list[LayerHeader], tier: str, nbytes: int
) -> PackView:
    """A `PackView` of `pack`'s own bytes, its records raw and of one size (`headers`, verified)."""
    first = headers[0]
    positions = meta.start + np.arange(meta.chunks_per_layer * meta.chunk_tokens, dtype=np.int64)
    stride = pack.offsets[1] - pack.offsets[0] if len(headers) > 1 else first.total_bytes
    return PackView(
        block_index, positions, pack.data, pack.offsets[0] + first.size, stride,
        first.total_bytes - first.size, first.chunk_shape(), first.dtype, tier, nbytes,
    )  # fmt: skip


def _decoded(meta: BlockMeta, pack: WholePack, headers: list[LayerHeader], model: ModelSpec) -> list[Array]:
    """Every layer's chunks of a pack whose headers were verified together (raw records)."""
    return [
        decode_layer_record(part, meta.chunk_id(meta.record_index(layer, 0)), True, header,
                            layer_geometry(meta, layer, model))[1]
        for layer, (part, header) in enumerate(zip(pack.parts, headers, strict=True))
    ]  # fmt: skip


def _verified_layers(
    fetcher: RecordFetcher, meta: BlockMeta, pack: WholePack, model: ModelSpec
) -> tuple[list[LayerHeader], list[Array]]:
    """Every layer record of `pack`: its header (checked against the geometry `meta` and `model`
    imply) and its chunks (num_chunks, 2, kv_heads, chunk_tokens, head_dim). Their bytes are
    verified already (`RecordFetcher.whole_pack`: memory's are trusted, a pack read from a slower
    tier has the checksum of all its records checked). A pack of raw records of one size (what
    stores write; memory holds only such) has its headers checked at once (memory's kept after the
    first time) and no chunks decoded (empty list): `_stacked` views them all."""
    kept = fetcher.known_pack(meta) if pack.trusted else None
    if kept is None:
        kept = _raw_headers_at_once(fetcher, meta, pack, model)
        if kept is not None and pack.trusted:
            fetcher.keep_pack(meta, kept)
    if kept is not None:
        return kept, []
    headers: list[LayerHeader] = []
    layers: list[Array] = []
    for layer, part in enumerate(pack.parts):  # zstd, or raw records of other sizes: one by one
        index, geometry = meta.record_index(layer, 0), layer_geometry(meta, layer, model)
        known = fetcher.known_header(meta, index, Fetched(part, pack.tier, pack.trusted), geometry)
        # chunks verified: memory's are trusted, and a pack read whole had its records' checksum checked
        header, chunks = decode_layer_record(part, meta.chunk_id(index), True, known, geometry)
        headers.append(header)
        layers.append(chunks)
    return headers, layers


def _raw_headers_at_once(
    fetcher: RecordFetcher, meta: BlockMeta, pack: WholePack, model: ModelSpec
) -> list[LayerHeader] | None:
    """The headers of a pack of raw records of one size, all checked at once: the first parsed and
    checked in full, the others compared with it (`headers_like`). None if the pack is not such."""
    offsets, parts = pack.offsets, pack.parts
    index, geometry = meta.record_index(0, 0), layer_geometry(meta, 0, model)
    first = fetcher.known_header(meta, index, Fetched(parts[0], pack.tier, pack.trusted), geometry)
    if first is None:
        first = parse_header(parts[0], meta.chunk_id(index), geometry)
    stride = offsets[1] - offsets[0] if len(offsets) > 1 else first.total_bytes
    uniform = first.codec == "raw" and first.total_bytes == stride
    if (
        not uniform
        or any(len(p) != stride for p in parts)
        or any(b - a != stride for a, b in itertools.pairwise(offsets))
    ):
        return None
    indices = [meta.record_index(layer, 0) for layer in range(meta.num_layers)]
    return headers_like(first, pack.data, offsets[0], stride, indices)


def _stacked(pack: WholePack, headers: list[LayerHeader]) -> Array | None:
    """Every layer's chunks as one strided view of the pack, (layers, chunks, 2, kv_heads,
    chunk_tokens, head_dim), when every record is raw and of one size (then they lie at one
    stride); else None. Only what `_verified_layers` verified is viewed."""
    first = headers[0]
    uniform = all(
        h.codec == "raw" and h.total_bytes == first.total_bytes and h.size == first.size for h in headers
    )
    stride = pack.offsets[1] - pack.offsets[0] if len(headers) > 1 else first.total_bytes
    if not uniform or any(b - a != stride for a, b in itertools.pairwise(pack.offsets)):
        return None
    shape = (len(headers), first.num_chunks, *first.chunk_shape())
    inner = [first.dtype.itemsize]  # a chunk's C-order strides, then the chunks'
    for size in reversed(shape[2:]):
        inner.insert(0, inner[0] * size)
    view: Array = np.ndarray(
        shape, first.dtype, buffer=pack.data, offset=pack.offsets[0] + first.size, strides=(stride, *inner)
    )
    view.flags.writeable = False
    return view
