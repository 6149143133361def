"""The embedded store's `LayeredLoad`: a cached prefix read layer by layer (query-aware loads).

`open_layered` takes the leading run of matched blocks stored in the layered layout
(kvstore/load/read_layered.py) and pins them until the load is closed. `key_summary` and
`packed_summary` hand out a layer's key summaries over the prefix (kvstore/load/layer_summaries.py:
read once per block, stacked per layer where memory holds them). `read_chunks` reads the chosen
chunks of a layer over the whole prefix as one gathered read (kvstore/load/layer_gather.py): from
the packs memory holds, or by offset from the disk's data file, all of a layer's reads in one
parallel submission, into one chunk-major destination. A block that neither can serve (a pack of
compressed records, the remote tier, layout v2) is read as before: its layer record whole when
every chunk is wanted (promoted), else the record's header (verified and kept for the load's
lifetime) and the chunks' byte ranges (not promoted).

A record that fails its checksum makes the store forget its block (as `load` does) and
raises ChecksumError; one whose header describes other geometry than the block's metadata
and the model (chunk size, chunk count, layer, dtype, kv heads, head dim) is counted in
`geometry_mismatches`, its block forgotten the same way, and raises GeometryError (a
ChecksumError). A remote record that fails is a miss (deleted there), so the block then
is in no tier: NotFoundError. A chunk read by offset from the data file that fails its checks is
read again through the tiers before anything is concluded (the place was located at open).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from importance.lowbit import LowBitKeys, dequantize, unpack_codes
from kvstore.api import LayerSlice
from kvstore.errors import InvalidInputError
from kvstore.format.block_meta import BlockMeta
from kvstore.format.key_summary import summary_record_bytes
from kvstore.format.layer_record import LayerHeader
from kvstore.format.layered_block import layer_geometry
from kvstore.load.ahead import LayersAhead
from kvstore.load.layer_gather import (
    LayerRuns,
    PackPlace,
    gather_file,
    gather_memory,
    locate_places,
    plan_runs,
    span_tier,
    verify_file_reads,
)
from kvstore.load.layer_ranges import RangedLayerReads
from kvstore.load.layer_summaries import FinishSummaries, SummaryReader
from kvstore.load.read_layered import layered_run
from kvstore.load.summaries import PackedLayer, join_lowbit
from kvstore.model import ModelSpec
from kvstore.stats import Counters
from kvstore.values import Array, check_chunks, check_layer
from radix import MatchResult
from radix.tree import Pin

if TYPE_CHECKING:
    from kvstore.index.store_index import StoreIndex
    from kvstore.load.fetch import RecordFetcher


def open_layered(
    fetcher: RecordFetcher, index: StoreIndex, match: MatchResult, model: ModelSpec,
    default_chunk_tokens: int, counters: Counters, finish_summaries: FinishSummaries | None = None,
) -> LocalLayeredLoad:  # fmt: skip
    """A `LocalLayeredLoad` over the layered run of `match`, its blocks pinned (see module docstring).
    `finish_summaries`: encodes a just-stored block's deferred summaries (kvstore/store/deferred.py)."""
    metas = layered_run(match, model)
    try:  # the matched nodes themselves: closing the load releases them, never a block stored again
        pin: Pin | None = index.tree.pin(match.nodes[: len(metas)])
    except KeyError:  # a block was evicted between the match and the pin: nothing to read this way
        metas, pin = [], None
    counters.add("layered_loads")
    return LocalLayeredLoad(
        fetcher, index, metas, model, default_chunk_tokens, counters, pin=pin,
        finish_summaries=finish_summaries,
    )  # fmt: skip


class LocalLayeredLoad:
    """The embedded store's `kvstore.api.LayeredLoad` (the contract is documented there).

    A chunk record missing from every tier (lost storage) is handled as a corrupt one,
    but raises NotFoundError.
    """

    def __init__(
        self, fetcher: RecordFetcher, index: StoreIndex, metas: list[BlockMeta], model: ModelSpec,
        default_chunk_tokens: int, counters: Counters, *, pin: Pin | None = None,
        finish_summaries: FinishSummaries | None = None,
    ) -> None:  # fmt: skip
        self._fetcher, self._index, self._metas, self._model = fetcher, index, metas, model
        self._counters = counters
        self.chunk_tokens = metas[0].chunk_tokens if metas else default_chunk_tokens
        self.matched_tokens = sum(m.num_tokens for m in metas)
        self.num_layers = model.num_layers
        self.prefix_bytes = sum(m.nbytes for m in metas)
        self.summary_bytes = sum(
            summary_record_bytes(m.num_tokens, model.num_kv_heads, model.head_dim) * m.num_layers
            for m in metas
        )
        self.bytes_read = 0
        self.delivered_tokens = 0
        self._layers_read: set[int] = set()
        self._summaries: dict[int, Array] = {}
        self._lowbit: dict[int, LowBitKeys] = {}
        self._pinned = pin  # released by `close`
        self._ranged = RangedLayerReads(fetcher, model, self._lose, self._count_read)
        self._summary_reader = SummaryReader(
            fetcher, metas, model, counters, self._lose, index.promote, self._count_read, finish_summaries
        )
        self._ahead: LayersAhead[Array] | None = None  # summaries read ahead (`key_summary`)
        self._ahead_next = 0  # the first layer the thread still owes
        self._packed_ahead: LayersAhead[PackedLayer] | None = None  # the same, packed (`packed_summary`)
        self._packed_next = 0
        self._places: list[PackPlace | None] | None = None  # where each pack lies (`_located`)
        self._file_headers: dict[tuple[int, int], LayerHeader] = {}  # (block, layer): read, verified
        self._lost: set[bytes] = set()  # blocks forgotten meanwhile: nothing of theirs is promoted
        self._lock = threading.Lock()  # the reader thread and the caller both count and cache

    @property
    def kv_dtype(self) -> np.dtype[Any]:
        """The numpy dtype of the KV `read_layer` delivers (the model's)."""
        return self._model.np_dtype

    @property
    def delivered_fraction(self) -> float:
        """Delivered tokens / (matched tokens x layers read); 0.0 before any layer."""
        denominator = self.matched_tokens * len(self._layers_read)
        return self.delivered_tokens / denominator if denominator else 0.0

    @property
    def read_fraction(self) -> float:
        """Bytes read / `prefix_bytes` (0.0 if nothing matched)."""
        return self.bytes_read / self.prefix_bytes if self.prefix_bytes else 0.0

    def key_summary(self, layer: int) -> Array:
        """Approximate keys of `layer`: float32 (kv_heads, matched_tokens, head_dim); see the contract.

        Asking for layer 0 first (a prefill does) starts a thread that reads and decodes the next
        layers' summaries while the model computes (kvstore/load/ahead.py). Only the latest
        layer's keys are kept (a prefix of 8k tokens: 6 MB a layer); an earlier one asked again
        is decoded again from its low-bit codes.
        """
        self._check_layer(layer)
        if layer in self._summaries:
            return self._summaries[layer]
        if self._ahead is None and layer == 0 and self.num_layers > 1 and self._metas:
            self._ahead = LayersAhead(self._decoded_summary, self.num_layers)
        if self._ahead is not None and layer >= self._ahead_next:
            keys = self._ahead.get(layer)
            self._ahead_next = layer + 1
        else:
            keys = self._decoded_summary(layer)
        self._summaries = {layer: keys}
        return keys

    def _decoded_summary(self, layer: int) -> Array:
        return dequantize(self.lowbit_summary(layer))

    def lowbit_summary(self, layer: int) -> LowBitKeys:
        """Layer `layer`'s summaries over the matched prefix as stored (what the sidecar sends):
        the blocks' codes side by side, one offset/step group per block. Read once."""
        self._check_layer(layer)
        if layer not in self._lowbit:
            parts = []
            for meta in self._metas:
                packed = self._summary_reader.verified(meta, layer)
                codes = unpack_codes(packed.codes, packed.bits, packed.shape)
                parts.append(LowBitKeys(codes, packed.low, packed.step, packed.bits, packed.group_tokens))
            self._lowbit[layer] = join_lowbit(parts, self._model)
        return self._lowbit[layer]

    def packed_summary(self, layer: int) -> PackedLayer:
        """Layer `layer`'s summaries over the matched prefix with their codes still packed, every
        block's side by side (for a device to unpack and score in one op: engine_adapter/runner/
        chunk_mass.py `device_keys`). Asking for layer 0 first starts a thread that reads the
        next layers' ahead, as `key_summary` does.

        Raises:
            InvalidInputError: layer out of range, or blocks of unlike geometry (use `key_summary`).
        """
        self._check_layer(layer)
        if self._packed_ahead is None and layer == 0 and self.num_layers > 1 and self._metas:
            self._packed_ahead = LayersAhead(self._summary_reader.packed, self.num_layers)
        if self._packed_ahead is not None and layer >= self._packed_next:
            self._packed_next = layer + 1
            return self._packed_ahead.get(layer)
        return self._summary_reader.packed(layer)

    def read_layer(self, layer: int, chunks: Sequence[int] | Array, out: Array | None = None) -> LayerSlice:
        """Chunks `chunks` of `layer`: positions ascending, kv (2, kv_heads, n, head_dim), written
        into `out` when given (of that shape and the model's dtype). `read_chunks`, then one
        transposing copy: a device installs `read_chunks`' layout itself.

        Raises:
            InvalidInputError: `out` of another shape or dtype.
        """
        part = self.read_chunks(layer, chunks)
        n = len(part.kv)
        model, c = self._model, self.chunk_tokens
        shape = (2, model.num_kv_heads, n * c, model.head_dim)
        _check_out(out, shape, model)
        kv = np.empty(shape, model.np_dtype) if out is None else out
        kv.reshape(2, model.num_kv_heads, n, c, model.head_dim)[...] = part.kv.transpose(1, 2, 0, 3, 4)
        return LayerSlice(part.positions, kv)

    def read_chunks(self, layer: int, chunks: Sequence[int] | Array, out: Array | None = None) -> LayerSlice:
        """Chunks `chunks` of `layer`, chunk-major: positions ascending, kv (n, 2, kv_heads,
        chunk_tokens, head_dim) as the records lay each chunk out, written into `out` when given
        (of that shape and the model's dtype: e.g. a page-locked buffer the device copies from
        next, so the host copies every byte once). One gathered read over the prefix (module
        docstring).

        Raises:
            InvalidInputError: `out` of another shape or dtype.
        """
        self._check_layer(layer)
        chosen = check_chunks(chunks, self.matched_tokens // self.chunk_tokens)
        c, model = self.chunk_tokens, self._model
        shape = (len(chosen), 2, model.num_kv_heads, c, model.head_dim)
        _check_out(out, shape, model)
        kv = np.empty(shape, model.np_dtype) if out is None else out
        if len(chosen):
            self._gather(layer, chosen, kv)
        self._layers_read.add(layer)
        self.delivered_tokens += len(chosen) * c
        positions = (chosen[:, None] * c + np.arange(c, dtype=np.int64)).reshape(-1)
        return LayerSlice(positions, kv)

    def _gather(self, layer: int, chosen: Array, kv: Array) -> None:
        """Sorted chunks `chosen` of `layer` into `kv`: memory's packs and the data file's in one
        gathered read each, any other block through the tiers."""
        runs = plan_runs(chosen, self._metas[0].chunks_per_layer)
        places = self._located()
        kind = np.array([_kind(p) for p in places], np.int8)[runs.block]
        # a block whose every chunk is wanted is read whole through the tiers: promoted to memory
        # once its pack's last layer is verified (a range is never promoted)
        whole = (
            np.bincount(runs.block, runs.length, len(places))[runs.block] == self._metas[0].chunks_per_layer
        )
        kind[(kind == 2) & whole] = 0
        rows = kv.reshape(len(chosen), -1).view(np.uint8)
        if (memory := _only(runs, kind == 1)).num_chunks:
            self._count_tier("memory", gather_memory(places, layer, memory, rows), memory)
        if (disk := _only(runs, kind == 2)).num_chunks:
            self._from_file(places, layer, disk, chosen, kv)
        for block in _only(runs, kind == 0).blocks().tolist():
            self._slow_block(block, layer, chosen, kv)

    def hint_layer(self, layer: int, chunks: Sequence[int] | Array) -> int:
        """Have the disk read these chunks of `layer` in the background (a speculation: the caller
        reads them, or others, with `read_chunks` later). Returns the chunks hinted (those of
        blocks the disk serves; memory's need no hint). Never raises for a bad guess."""
        chosen = np.unique(np.asarray(chunks, dtype=np.int64))
        total = self.matched_tokens // self.chunk_tokens
        chosen = chosen[(chosen >= 0) & (chosen < total)]
        disk = span_tier(self._fetcher)
        if not len(chosen) or disk is None or not 0 <= layer < self.num_layers:
            return 0
        places = self._located()
        runs = plan_runs(chosen, self._metas[0].chunks_per_layer)
        spans, hinted = [], 0
        for block, first, count in zip(
            runs.block.tolist(), runs.first.tolist(), runs.length.tolist(), strict=True
        ):
            place = places[block]
            if place is not None and place.memory is None:
                start = place.file_offset + place.chunk_at(layer, first)
                spans.append((start - place.header_size * (first == 0), count * place.chunk_bytes))
                hinted += count
        if spans:
            disk.will_need(spans)
        return hinted

    @property
    def reads_from_disk(self) -> bool:
        """Whether some block is read by offset from the disk's data file (not memory's)."""
        return any(p is not None and p.memory is None for p in self._located())

    @property
    def pinned_keys(self) -> tuple[bytes, ...]:
        """Keys of the blocks this load keeps pinned (empty once closed)."""
        return () if self._pinned is None else self._pinned.keys

    def close(self) -> None:
        """Stop reading ahead, then release the pin: exactly the nodes `open_layered` pinned. Idempotent."""
        for ahead in (self._ahead, self._packed_ahead):
            if ahead is not None:
                ahead.stop()
        with self._lock:
            lost = set(self._lost)
        self._summary_reader.promote_pending(lost)
        pin, self._pinned = self._pinned, None
        if pin is not None:
            self._index.tree.unpin(pin)

    def __enter__(self) -> LocalLayeredLoad:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ----------------------------------------------------------------

    def _check_layer(self, layer: int) -> None:
        check_layer(layer, self.num_layers)

    def _located(self) -> list[PackPlace | None]:
        """Where each block's pack lies, located on first use (memory's, or the data file's)."""
        if self._places is None:
            self._places = locate_places(self._fetcher, self._metas, self._model)
        return self._places

    def _count_tier(self, tier: str, nbytes: int, runs: LayerRuns) -> None:
        self._count_read(nbytes)
        self._counters.add_many(
            {f"bytes_read.{tier}": nbytes, f"chunk_hits.{tier}": len(runs.blocks()),
             f"gathered_chunks.{tier}": runs.num_chunks}
        )  # fmt: skip

    def _from_file(
        self, places: list[PackPlace | None], layer: int, runs: LayerRuns, chosen: Array, kv: Array
    ) -> None:
        """`runs` read by offset from the data file and verified; a block that fails is read again
        through the tiers (which forgets it and raises if its record is really corrupt)."""
        disk = span_tier(self._fetcher)
        assert disk is not None
        rows = kv.reshape(len(kv), -1).view(np.uint8)
        reads, nbytes = gather_file(
            places, layer, runs, rows, disk.read_spans, lambda block: self._file_headers.get((block, layer))
        )
        self._count_tier(disk.name, nbytes, runs)

        def expect(block: int) -> tuple[Any, Any]:
            meta = self._metas[block]
            return meta.chunk_id(meta.record_index(layer, 0)), layer_geometry(meta, layer, self._model)

        verified, failed = verify_file_reads(reads, rows, expect)
        self._file_headers.update({(block, layer): header for block, header in verified.items()})
        for block in failed:
            with self._lock:  # located at open, wrong now: read through the tiers from now on
                self._located()[block] = None
            self._slow_block(block, layer, chosen, kv)

    def _slow_block(self, block: int, layer: int, chosen: Array, kv: Array) -> None:
        """Block `block`'s chunks among `chosen` (the layer's, sorted) read through the tiers, into
        their slots of `kv`."""
        per_block = self._metas[0].chunks_per_layer
        first, end = np.searchsorted(chosen, [block * per_block, (block + 1) * per_block]).tolist()
        mine = (chosen[first:end] - block * per_block).tolist()
        self._ranged.read(self._metas[block], block, layer, mine, kv[first:end])

    def _count_read(self, nbytes: int) -> None:
        with self._lock:  # the reader thread counts summaries while the caller counts chunks
            self.bytes_read += nbytes

    def _lose(self, meta: BlockMeta, counter: str) -> None:
        with self._lock:
            self._lost.add(meta.key)
        self._counters.add(counter)
        self._fetcher.forget(meta.key)
        self._index.forget(meta.key)


def _check_out(out: Array | None, shape: tuple[int, ...], model: ModelSpec) -> None:
    if out is not None and (out.shape != shape or out.dtype != model.np_dtype):
        raise InvalidInputError(f"out must be {model.dtype} of shape {shape}, got {out.dtype} {out.shape}")


def _kind(place: PackPlace | None) -> int:
    """0: read through the tiers; 1: memory's pack; 2: the data file by offset."""
    return 0 if place is None else 1 if place.memory is not None else 2


def _only(runs: LayerRuns, mask: Array) -> LayerRuns:
    return LayerRuns(*(part[mask] for part in runs))
