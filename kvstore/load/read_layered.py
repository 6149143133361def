"""Reading blocks of the layered layout: how a load joins their layer records into chunks.

The records and their encoding are kvstore/format/layered_block.py. A normal `load` selects
units: chunk c of every layer, joined into one all-layer chunk (`load_units`); a
partial load reads a layer record's header and its chosen chunks' byte ranges. Every header
is checked against the geometry the block's metadata and the model imply before any chunk of
it is used (kvstore/format/layered_block.py `layer_geometry`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from kvstore.errors import ChecksumError
from kvstore.format.block_meta import BlockMeta
from kvstore.format.layer_record import (
    LayerHeader,
    decode_layer_record,
    decode_run,
    header_bytes,
    parse_header,
)
from kvstore.format.layered_block import layer_geometry
from kvstore.load.assemble import copy_pairs
from kvstore.load.fetch import Fetched, FetchedRanges, RecordFetcher
from kvstore.model import ModelSpec
from kvstore.values import Array, LoadedChunk

if TYPE_CHECKING:
    from kvstore.tiers.base import Tier
    from radix import MatchResult


def reads_whole(needed: int, chunks_per_layer: int) -> bool:
    """Whether a load reads a layer record whole from a tier: only when it needs every chunk.

    A budget means bytes: a partial load reads the header and the chosen chunks' byte
    ranges only (LMDB copies them out of its map, Redis sends one GETRANGE per run of
    adjacent chunks), so what it reads never exceeds what it delivers by more than the
    headers. Reading whole past half the chunks read 0.69 of the bytes for a 0.5 budget.
    """
    return needed >= chunks_per_layer


def load_units(
    fetcher: RecordFetcher, meta: BlockMeta, block_index: int, units: Sequence[int], model: ModelSpec,
    into: Array | None = None,
) -> list[LoadedChunk] | None:  # fmt: skip
    """One all-layer `LoadedChunk` per unit (chunk u of every layer), bit-exact, or None if a
    layer record is in no tier. Each layer record is read whole when memory holds them all (a
    view: nothing is copied but the chosen chunks) or when the load needs more than
    every chunk (`reads_whole`; then promoted to memory), else as its header and the
    chosen chunks' byte ranges. Raises ChecksumError on a corrupt local record (GeometryError on
    one whose header describes other geometry than `meta` and `model` imply).

    `into`: where the caller will copy the units to, (layers, 2, heads, len(units) * chunk
    tokens, dim) in the records' dtype (a slice of its destination, kvstore/load/assemble.py
    `Destination`). The chosen chunks are then copied there, unit i at tokens [i * c, (i + 1) * c),
    and each unit's KV is a view of it: the caller's copy finds them in place and copies
    nothing. Without it each unit's KV is a view of one new array of the block's units.

    A unit's `nbytes` are its chunks' stored bytes; the first unit also carries what was read
    beside them (headers, and the other chunks of a record read whole from a slower tier);
    its tier is the slowest one a part came from.
    """
    if not units:
        return []
    layers = meta.num_layers
    order = np.asarray(units, dtype=np.int64)
    indices = _layer_indices(meta)
    whole = reads_whole(len(set(units)), meta.chunks_per_layer) or fetcher.all_in_memory(meta, indices)
    parts = fetcher.whole_records(meta, indices, model) if whole else None
    runs = runs_of(order)
    out: Array | None = None
    copies: list[tuple[Array, Array]] = []  # (part of out, chunks), made once every layer is read
    lengths: list[list[int]] = []
    read = 0  # bytes read beside the chosen chunks
    tiers: set[str] = set()
    for layer in range(layers):
        if whole:
            got = _whole_layer(fetcher, meta, layer, parts, order, model)
        else:
            got = _ranged_layer(fetcher, meta, layer, order, model)
        if got is None:
            return None
        chunks, layer_lengths, overhead, tier = got
        if out is None:
            out = units_array(into, layers, len(units), chunks)
        dest = layer_units_view(out, into is out, layers, len(units))[layer]
        copies.extend(_run_copies(dest, chunks, runs))
        lengths.append(layer_lengths)
        read += overhead
        tiers.add(tier)
    assert out is not None
    copy_pairs(copies)  # in two threads: the block's layers are 6 MB for SmolLM2
    tier = next((t for t in tiers if t != "memory"), "memory")
    return loaded_units(meta, block_index, order, out, into is out, np.asarray(lengths, np.int64), read, tier)


def loaded_units(
    meta: BlockMeta, block_index: int, order: Array, out: Array, token_major: bool, lengths: Array,
    beside: int, tier: str, runs: bool = False,
) -> list[LoadedChunk]:  # fmt: skip
    """The `LoadedChunk` of each unit `order[i]`, its KV a view of `out` (`units_array`) and its
    `nbytes` its chunks' stored `lengths` (layers, chunks) summed, the first one's plus `beside`.

    `runs`: where `out` is the caller's destination (`token_major`), one `LoadedChunk` per run of
    consecutive units instead (a full block is one): its tokens are adjacent there, and every
    chunk a load yields costs a round of Python in each consumer (256 units of 8 tokens a
    2,048-token load, where the importance layout yields 128 chunks)."""
    c = meta.chunk_tokens
    per_unit = lengths[:, order].sum(axis=0)
    per_unit[0] += beside
    if token_major and runs:  # one chunk per run of consecutive units: a view of its tokens
        ends = np.cumsum(per_unit).tolist()
        return [
            LoadedChunk(
                block_index, chunk, meta.start + np.arange(chunk * c, (chunk + count) * c, dtype=np.int64),
                out[:, :, :, first * c : (first + count) * c], tier,
                int(ends[first + count - 1] - (ends[first - 1] if first else 0)),
            )
            for first, chunk, count in runs_of(order)
        ]  # fmt: skip
    positions = meta.start + order[:, None] * c + np.arange(c, dtype=np.int64)
    if token_major:  # unit i is tokens [i * c, (i + 1) * c) of the caller's destination
        kvs = [out[:, :, :, i * c : (i + 1) * c] for i in range(len(order))]
    else:
        kvs = [out[:, i] for i in range(len(order))]
    return [
        LoadedChunk(block_index, u, positions[i], kvs[i], tier, nbytes)
        for i, (u, nbytes) in enumerate(zip(order.tolist(), per_unit.tolist(), strict=True))
    ]


def units_array(into: Array | None, layers: int, num_units: int, chunks: Array) -> Array:
    """`into` if the chunks fit it as they are (shape and dtype), else a new array of the units,
    (layers, units, 2, heads, c, dim): each unit's layers then lie in contiguous runs."""
    _, two, heads, c, dim = chunks.shape
    fits = into is not None and into.shape == (layers, two, heads, num_units * c, dim)
    if fits and into is not None and into.dtype == chunks.dtype:
        return into
    return np.empty((layers, num_units, *chunks.shape[1:]), chunks.dtype)


def layer_units_view(out: Array, token_major: bool, layers: int, num_units: int) -> Array:
    """`out` (`units_array`) as (layers, units, 2, heads, c, dim), a view (no copy is made)."""
    if not token_major:
        return out
    two, heads, tokens, dim = out.shape[1:]
    return out.reshape(layers, two, heads, num_units, tokens // num_units, dim).transpose(0, 3, 1, 2, 4, 5)


def runs_of(order: Array) -> list[tuple[int, int, int]]:
    """(first unit, first chunk, count) per run of consecutive chunk numbers in `order`: a run is
    one strided copy (a full load in order is one run per layer)."""
    breaks = np.flatnonzero(np.diff(order) != 1) + 1
    starts = np.concatenate(([0], breaks)).tolist()
    ends = [*breaks.tolist(), len(order)]
    return [(a, int(order[a]), b - a) for a, b in zip(starts, ends, strict=True)]


def _run_copies(dest: Array, chunks: Array, runs: list[tuple[int, int, int]]) -> list[tuple[Array, Array]]:
    """(dest part, chunks part) per run: copied, they make dest[i] = chunks[order[i]] for every unit i."""
    return [(dest[first : first + count], chunks[chunk : chunk + count]) for first, chunk, count in runs]


def _layer_indices(meta: BlockMeta) -> list[int]:
    return [meta.record_index(layer, 0) for layer in range(meta.num_layers)]


# chunks (all of the record's, 2, heads, c, dim; only the chosen ones valid), every chunk's
# stored length, bytes read beside the chosen chunks (headers, unchosen chunks), tier
LayerPart = tuple[Array, list[int], int, str]


def _whole_layer(
    fetcher: RecordFetcher, meta: BlockMeta, layer: int, parts: list[Fetched] | None, order: Array,
    model: ModelSpec,
) -> LayerPart | None:  # fmt: skip
    """The chosen chunks of a layer record read whole: verified, then promoted to memory."""
    if parts is None:
        return None
    fetched, index = parts[layer], meta.record_index(layer, 0)
    geometry = layer_geometry(meta, layer, model)
    known = fetcher.known_header(meta, index, fetched, geometry)
    if known is not None and known.codec == "raw" and len(fetched.data) == known.total_bytes:
        # the hot path (a record memory holds, header known): a view of the chunks, nothing checked
        shape = (known.num_chunks, *known.chunk_shape())
        chunks = np.frombuffer(fetched.data, known.dtype, offset=known.size).reshape(shape)
        return chunks, known.lengths, known.size, fetched.tier
    header, chunks = decode_layer_record(fetched.data, meta.chunk_id(index), fetched.trusted, known, geometry)
    fetcher.promote(meta, index, fetched, header, chunks)
    if fetched.trusted:  # memory hands out a view: only the header and the chosen chunks are touched
        return chunks, header.lengths, header.size, fetched.tier
    if len(order) == header.num_chunks and len(set(order.tolist())) == len(order):
        chosen = header.total_bytes - header.size  # every chunk
    else:
        chosen = sum(header.lengths[u] for u in set(order.tolist()))
    return chunks, header.lengths, len(fetched.data) - chosen, fetched.tier


def _ranged_layer(
    fetcher: RecordFetcher, meta: BlockMeta, layer: int, order: Array, model: ModelSpec
) -> LayerPart | None:
    """The header range, then the chosen chunks' ranges (adjacent ones merged), from one tier."""
    index = meta.record_index(layer, 0)
    head = read_header(fetcher, meta, index, model)
    if head is None:
        return None
    got = read_chunk_runs(fetcher, meta, index, head, sorted(set(order.tolist())))
    if got is None:
        return None
    # indexed by chunk number, as a whole record's chunks are (np.empty: the rest is never touched)
    chunks = np.empty((meta.chunks_per_layer, *head.header.chunk_shape()), head.header.dtype)
    for members, run in got[0]:
        chunks[members[0] : members[-1] + 1] = run
    return chunks, head.header.lengths, head.header.size, head.tier.name  # just the chosen chunks


class RangedHeader(NamedTuple):
    """A layer record's verified header and the tier it was read from (its chunks are read there)."""

    header: LayerHeader
    tier: Tier


def read_header(fetcher: RecordFetcher, meta: BlockMeta, index: int, model: ModelSpec) -> RangedHeader | None:
    """The header range of layer record `index`, verified, from the fastest tier holding it; its
    geometry must be what `meta` and `model` imply. None if no tier holds it (a remote header
    that fails its checks is a miss: `RecordFetcher.refuse_remote`).

    Raises:
        ChecksumError: a local header fails its checks (GeometryError: describes other geometry).
    """
    head = fetcher.ranges(meta, index, [(0, header_bytes(meta.chunks_per_layer))])
    return None if head is None else _verified_header(fetcher, meta, index, head, model)


class RawRuns(NamedTuple):
    """What `read_raw_runs` read: the verified header, the chunks as runs of (n, 2, kv_heads, c,
    head_dim) arrays (None: the header lays them out elsewhere, a compressed record), bytes read."""

    head: RangedHeader
    runs: list[Array] | None
    nbytes: int


def read_raw_runs(
    fetcher: RecordFetcher, meta: BlockMeta, index: int, wanted: Sequence[int], model: ModelSpec
) -> RawRuns | None:
    """The header of layer record `index` and its sorted chunks `wanted` in one ranged read, the
    chunks' byte ranges as an uncompressed record lays them out (adjacent chunks merged): one read
    per block and layer where `read_header` then `read_chunk_runs` make two (480 header reads a
    4,096-token query-aware prefill, issue #27 item 5). None as `read_header`.

    Raises:
        ChecksumError: the header or a chunk fails its checks (GeometryError: other geometry).
    """
    size = header_bytes(meta.chunks_per_layer)
    chunk_bytes = 2 * model.num_kv_heads * meta.chunk_tokens * model.head_dim * model.itemsize
    laid_out = [
        (size + first * chunk_bytes, size + (first + count) * chunk_bytes, list(range(first, first + count)))
        for _, first, count in runs_of(np.asarray(wanted, dtype=np.int64))
    ]
    got = fetcher.ranges(meta, index, [(0, size), *[(start, end) for start, end, _ in laid_out]])
    head = None if got is None else _verified_header(fetcher, meta, index, got, model)
    if got is None or head is None:
        return None
    nbytes = sum(len(d) for d in got.data)
    if head.header.codec != "raw" or head.header.ranges(wanted) != laid_out:
        return RawRuns(head, None, nbytes)
    runs = [
        decode_run(head.header, data, members, got.trusted)
        for (_, _, members), data in zip(laid_out, got.data[1:], strict=True)
    ]
    return RawRuns(head, runs, nbytes)


def _verified_header(
    fetcher: RecordFetcher, meta: BlockMeta, index: int, got: FetchedRanges, model: ModelSpec
) -> RangedHeader | None:
    """The header at the start of `got.data[0]`, checked against `meta` and `model`; None for a
    remote one that fails (a miss there), else a failure raises ChecksumError."""
    geometry = layer_geometry(meta, index - meta.num_layers, model)
    try:
        return RangedHeader(parse_header(got.data[0], meta.chunk_id(index), geometry), got.tier)
    except ChecksumError as exc:
        if fetcher.refuse_remote(got.tier, meta, exc):
            return None
        raise


def read_chunk_runs(
    fetcher: RecordFetcher, meta: BlockMeta, index: int, head: RangedHeader, wanted: Sequence[int]
) -> tuple[list[tuple[list[int], Array]], int] | None:
    """Sorted chunks `wanted` of record `index`, read from `head.tier` as runs of adjacent chunks and
    verified: ([(run's chunks, their KV)], bytes read); None if that tier no longer holds the record.

    Raises:
        ChecksumError: a chunk fails its checksum.
    """
    runs = head.header.ranges(wanted)
    body = fetcher.ranges(meta, index, [(start, end) for start, end, _ in runs], only=head.tier)
    if body is None:
        return None
    decoded = [
        (members, decode_run(head.header, data, members, body.trusted))
        for (_, _, members), data in zip(runs, body.data, strict=True)
    ]
    return decoded, sum(len(d) for d in body.data)


def layered_run(match: MatchResult, model: ModelSpec) -> list[BlockMeta]:
    """The leading matched blocks readable layer by layer: layered, of this model's depth, with
    the first one's chunk size (a block written under another setting ends the run)."""
    metas: list[BlockMeta] = []
    for node in match.nodes:
        meta: BlockMeta = node.payload
        if not meta.is_layered or meta.num_layers != model.num_layers:
            break
        if metas and meta.chunk_tokens != metas[0].chunk_tokens:
            break
        metas.append(meta)
    return metas
