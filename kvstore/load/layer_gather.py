"""Gathered reads of one layer's chosen chunks over a whole prefix: one plan, one pass of copies.

A query-aware load reads, per layer, the chunks the question chose from every block of the
prefix. Read block by block, that cost several rounds of Python per block and layer: 64 blocks
x 32 layers at 16k tokens of an 8B-shaped model, 0.69 s of a 1.24 s warm load on an H200's host
(../shared/device/runs/2026-11-28/profiles.txt). Here a layer's choice becomes one `LayerRuns`
(arrays: per run of adjacent chosen chunks of one block, the block, its first chunk, the count
and the slot the run lands in), made in a few vector operations, and the chunks come from where
each block lies, located once per load (`PackPlace`):

- memory: the pack the memory tier holds (kvstore/load/read_packed.py `held_view`), trusted as
  every read of memory is: a run is one copy of contiguous bytes;
- disk: the pack's place in LMDB's data file (kvstore/tiers/disk/lmdb.py `value_spans`): per
  block, one `preadv` of the layer record's header and, into the destination itself, each run
  (`FileGather`), all of a layer's reads issued at once on the disk's reading threads; each
  header and chunk is verified after the read, by the header's own checksum, identity and
  geometry and each chunk's xxh3.

Destinations are chunk-major, (chunks, 2, kv_heads, chunk_tokens, head_dim): a chunk's bytes land
as they lie in the record, with no transposition on the host (the device reorders them where it
installs them, engine_adapter/runner/device.py `read_into_cache`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol, runtime_checkable

import numpy as np

from kvstore.errors import ChecksumError
from kvstore.format.block_meta import BlockMeta
from kvstore.format.layer_pack import table_bytes
from kvstore.format.layer_record import LayerGeometry, LayerHeader, header_bytes, parse_header
from kvstore.format.layered_block import chunks_match
from kvstore.load.assemble import copy_pairs
from kvstore.load.fetch import RecordFetcher
from kvstore.load.read_packed import held_view
from kvstore.model import ModelSpec
from kvstore.values import Array

#: Reads one layer's file spans: [(file offset, buffers filled in order)] -> bytes read of each.
SpanReader = Callable[[Sequence[tuple[int, Sequence[memoryview]]]], list[int]]


class LayerRuns(NamedTuple):
    """One layer's chosen chunks as runs of adjacent chunks of one block (arrays of one length):
    the run's block (index in the prefix), its first chunk in the block, its chunk count, and the
    destination slot of its first chunk (the chunks land in prompt order)."""

    block: Array
    first: Array
    length: Array
    slot: Array

    @property
    def num_chunks(self) -> int:
        """Chunks in all runs."""
        return int(self.length.sum())

    def blocks(self) -> Array:
        """The blocks with at least one chosen chunk, ascending."""
        return np.unique(self.block)


def plan_runs(chosen: Array, chunks_per_block: int) -> LayerRuns:
    """`LayerRuns` of sorted distinct prefix chunk indices `chosen` (blocks of `chunks_per_block`)."""
    chosen = np.asarray(chosen, dtype=np.int64)
    if len(chosen) == 0:
        empty = np.zeros(0, np.int64)
        return LayerRuns(empty, empty, empty, empty)
    block = chosen // chunks_per_block
    breaks = np.flatnonzero((np.diff(chosen) != 1) | (np.diff(block) != 0)) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.append(breaks, len(chosen))
    return LayerRuns(block[starts], chosen[starts] - block[starts] * chunks_per_block, ends - starts, starts)


class PackPlace(NamedTuple):
    """Where one packed block's layer records lie: in `memory` (a uint8 view of the pack memory
    holds) or at `file_offset` of the disk's data file. Chunk c of layer L lies `base + L * stride
    + c * chunk_bytes` bytes into the pack, its record's header the `header_size` bytes before
    chunk 0 (raw records of one size, what stores write)."""

    memory: Array | None
    file_offset: int
    base: int
    stride: int
    header_size: int
    chunk_bytes: int

    def chunk_at(self, layer: int, chunk: int) -> int:
        """Offset of chunk `chunk` of layer `layer` from the pack's start."""
        return self.base + layer * self.stride + chunk * self.chunk_bytes


def gather_memory(places: Sequence[PackPlace | None], layer: int, runs: LayerRuns, out: Array) -> int:
    """Copy `runs` of layer `layer` from memory into `out` (chunks, chunk_bytes) uint8, in two
    threads where there is enough (numpy lets go of the GIL for a large copy); returns the bytes
    copied. Every run's block must have a memory place."""
    pairs: list[tuple[Array, Array]] = []
    for block, first, count, slot in zip(
        runs.block.tolist(), runs.first.tolist(), runs.length.tolist(), runs.slot.tolist(), strict=True
    ):
        place = places[block]
        assert place is not None and place.memory is not None
        start = place.chunk_at(layer, first)
        pairs.append(
            (out[slot : slot + count].reshape(-1), place.memory[start : start + count * place.chunk_bytes])
        )
    copy_pairs(pairs)
    return sum(src.nbytes for _, src in pairs)


class FileRead(NamedTuple):
    """What `gather_file` read for one block: its header (the bytes read, or the one verified
    before and kept) and the runs it delivered."""

    block: int
    header: memoryview | LayerHeader
    chunks: list[int]  # the block's chosen chunks, ascending
    slots: list[int]  # their destination slots


def gather_file(
    places: Sequence[PackPlace | None],
    layer: int,
    runs: LayerRuns,
    out: Array,
    read: SpanReader,
    known: Callable[[int], LayerHeader | None] = lambda block: None,
) -> tuple[list[FileRead], int]:
    """Read `runs` of layer `layer` from the data file into `out` (chunks, chunk_bytes) uint8 and
    each touched block's layer record header beside them (unless `known(block)` has it, verified
    before), in one submission (`read`: parallel preads). Returns what was read per block (to
    verify: `verify_file_reads`) and the bytes read.

    Raises:
        ChecksumError: a read came back short (the file no longer holds the pack there).
    """
    spans: list[tuple[int, list[memoryview]]] = []
    reads: dict[int, FileRead] = {}
    for block, first, count, slot in zip(
        runs.block.tolist(), runs.first.tolist(), runs.length.tolist(), runs.slot.tolist(), strict=True
    ):
        place = places[block]
        assert place is not None
        rows = out[slot : slot + count].reshape(-1).data
        got = reads.get(block)
        if got is None and (kept := known(block)) is not None:
            got = reads[block] = FileRead(block, kept, [], [])
        if got is None:
            header = memoryview(bytearray(place.header_size))
            got = reads[block] = FileRead(block, header, [], [])
            record = place.file_offset + place.chunk_at(layer, 0) - place.header_size
            if first == 0:  # the run follows the header in the file: one read fills both
                spans.append((record, [header, rows]))
            else:
                spans.append((record, [header]))
                spans.append((place.file_offset + place.chunk_at(layer, first), [rows]))
        else:
            spans.append((place.file_offset + place.chunk_at(layer, first), [rows]))
        got.chunks.extend(range(first, first + count))
        got.slots.extend(range(slot, slot + count))
    done = read(spans)
    wanted = [sum(b.nbytes for b in buffers) for _, buffers in spans]
    if done != wanted:
        raise ChecksumError(
            f"layer {layer}: short reads from the data file ({sum(done)} of {sum(wanted)} bytes)"
        )
    return list(reads.values()), sum(done)


def verify_file_reads(
    reads: Sequence[FileRead], out: Array, expect: Callable[[int], tuple[Any, LayerGeometry]]
) -> tuple[dict[int, LayerHeader], list[int]]:
    """Check each block's header read from the file (its checksum, identity and geometry: `expect`
    (block) -> (ChunkId, LayerGeometry)), that it lays raw chunks out as `PackPlace` assumed, and
    each chunk read by its checksum there. Returns the verified headers by block (to keep) and the
    blocks that failed (empty: all verified)."""
    failed: list[int] = []
    verified: dict[int, LayerHeader] = {}
    for got in reads:
        header = got.header
        if not isinstance(header, LayerHeader):
            record_id, geometry = expect(got.block)
            try:
                header = parse_header(header, record_id, geometry)
            except ChecksumError:
                failed.append(got.block)
                continue
        if not _raw_at_place(header, out.shape[1]) or not chunks_match(
            header, got.chunks, [out[slot] for slot in got.slots]
        ):
            failed.append(got.block)
        else:
            verified[got.block] = header
    return verified, failed


def _raw_at_place(header: LayerHeader, chunk_bytes: int) -> bool:
    """Whether the record's chunks are raw ones of `chunk_bytes`, right after its header."""
    return (
        header.codec == "raw"
        and header.size == header_bytes(header.num_chunks)
        and all(length == chunk_bytes for length in header.lengths)
    )


@runtime_checkable
class SpanTier(Protocol):
    """A durable tier whose records lie in one file that can be read by offset (LMDB's)."""

    name: str

    def value_spans(self, requests: Sequence[tuple[BlockMeta, int]]) -> list[tuple[int, int] | None]:
        """(file offset, bytes) of each record, or None; reads nothing."""
        ...

    def read_spans(self, spans: Sequence[tuple[int, Sequence[memoryview]]]) -> list[int]:
        """Fill the buffers of each span from its offset; bytes read of each."""
        ...

    def will_need(self, spans: Sequence[tuple[int, int]]) -> None:
        """Have the kernel read these spans in the background."""
        ...


def span_tier(fetcher: RecordFetcher) -> SpanTier | None:
    """The store's local durable tier that reads by file offset, if it has one."""
    return next((t for t in fetcher.tiers.local_durable if isinstance(t, SpanTier)), None)


def locate_places(
    fetcher: RecordFetcher, metas: Sequence[BlockMeta], model: ModelSpec
) -> list[PackPlace | None]:
    """Where each block's pack lies for gathered reads: memory's bytes (`held_view`), else its place
    in the disk's data file, where the value has the size of raw records of one size (what stores
    write; a compressed pack is read by ranges). None: neither (remote, compressed, layout v2)."""
    chunk_bytes = 2 * model.num_kv_heads * model.head_dim * model.itemsize
    places: list[PackPlace | None] = []
    for block_index, meta in enumerate(metas):
        view = None
        if meta.is_packed:
            with contextlib.suppress(ChecksumError):  # read by ranges: that path forgets and raises
                view = held_view(fetcher, meta, block_index, model)
        places.append(
            None if view is None else PackPlace(
                np.frombuffer(view.data, np.uint8), 0, view.first, view.layer_stride,
                header_bytes(meta.chunks_per_layer), chunk_bytes * meta.chunk_tokens,
            )
        )  # fmt: skip
    disk = span_tier(fetcher)
    missing = [i for i, place in enumerate(places) if place is None and metas[i].is_packed]
    if disk is None or not missing:
        return places
    spans = disk.value_spans([(metas[i], metas[i].pack_index) for i in missing])
    for i, span in zip(missing, spans, strict=True):
        meta = metas[i]
        per, layers = meta.chunks_per_layer, meta.num_layers
        size, one = header_bytes(per), chunk_bytes * meta.chunk_tokens
        if span is not None and span[1] == table_bytes(layers) + layers * (size + per * one):
            places[i] = PackPlace(None, span[0], table_bytes(layers) + size, size + per * one, size, one)
    return places
