"""The embedded store's `LayeredLoad`: a cached prefix read layer by layer (query-aware loads).

`open_layered` takes the leading run of matched blocks stored in the layered layout
(kvstore/load/read_layered.py) and pins them until the load is closed. `key_summary`
reads one summary record per block of a layer (fastest tier first; promoted to memory
when the load closes). `read_layer` reads the chosen chunks of each block's layer
record: the whole record (promoted) when it wants every chunk, else the record's header
(verified and kept for the load's lifetime) and the chunks' byte ranges (not promoted),
in one read while the records are uncompressed.

A record that fails its checksum makes the store forget its block (as `load` does) and
raises ChecksumError; one whose header describes other geometry than the block's metadata
and the model (chunk size, chunk count, layer, dtype, kv heads, head dim) is counted in
`geometry_mismatches`, its block forgotten the same way, and raises GeometryError (a
ChecksumError). A remote record that fails is a miss (deleted there), so the block then
is in no tier: NotFoundError.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from importance.lowbit import LowBitKeys, dequantize, unpack_codes
from kvstore.api import LayerSlice
from kvstore.errors import ChecksumError, InvalidInputError, KVSieveError, NotFoundError
from kvstore.format.block_meta import BlockMeta
from kvstore.format.chunk import GeometryError
from kvstore.format.key_summary import DecodedSummary, PackedSummary, summary_record_bytes, verify_summary
from kvstore.format.layer_record import decode_layer_record
from kvstore.format.layered_block import layer_geometry, summary_geometry
from kvstore.load.ahead import LayersAhead
from kvstore.load.read_layered import (
    RangedHeader,
    layered_run,
    read_chunk_runs,
    read_header,
    read_raw_runs,
    reads_whole,
)
from kvstore.load.summaries import PackedLayer, join_lowbit, join_packed
from kvstore.model import ModelSpec
from kvstore.stats import Counters
from kvstore.values import Array, check_chunks, check_layer
from radix import MatchResult
from radix.tree import Pin

if TYPE_CHECKING:
    from kvstore.index.store_index import StoreIndex
    from kvstore.load.fetch import RecordFetcher
    from kvstore.tiers.base import Tier


#: Encodes block `key`'s summaries now if a Store deferred them (no-op otherwise).
FinishSummaries = Callable[[bytes], object]


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
        self._finish_summaries = finish_summaries
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
        self._headers: dict[tuple[int, int], RangedHeader] = {}  # (block, layer): verified
        # (tier, block key): every layer's summary record, read at once (`_summary_record`)
        self._summary_records: dict[tuple[str, bytes], list[bytes | None]] = {}
        self._ahead: LayersAhead[Array] | None = None  # summaries read ahead (`key_summary`)
        self._ahead_next = 0  # the first layer the thread still owes
        self._packed_ahead: LayersAhead[PackedLayer] | None = None  # the same, packed (`packed_summary`)
        self._packed_next = 0
        # summaries read from a slower tier, promoted to memory when the load closes: off the
        # prefill's path (480 promotions of a 4,096-token prefix cost ~40 ms of a core there)
        self._promote_later: list[tuple[BlockMeta, int, bytes]] = []
        self._lost: set[bytes] = set()  # blocks forgotten meanwhile: nothing of theirs is promoted
        # header and chunks in one read (`read_raw_runs`) until a record turns out compressed
        self._raw_records = True
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
            self._ahead = LayersAhead(self._read_ahead, self.num_layers)
        if self._ahead is not None and layer >= self._ahead_next:
            keys = self._ahead.get(layer)
            self._ahead_next = layer + 1
        else:
            keys = self._decoded_summary(layer)
        self._summaries = {layer: keys}
        return keys

    def _read_ahead(self, layer: int) -> Array:
        """The reader thread's work for `layer`: its decoded summary. (Layer record headers are read
        with the chosen chunks, in one read: `read_raw_runs`.)"""
        return self._decoded_summary(layer)

    def _decoded_summary(self, layer: int) -> Array:
        return dequantize(self.lowbit_summary(layer))

    def lowbit_summary(self, layer: int) -> LowBitKeys:
        """Layer `layer`'s summaries over the matched prefix as stored (what the sidecar sends):
        the blocks' codes side by side, one offset/step group per block. Read once."""
        self._check_layer(layer)
        if layer not in self._lowbit:
            parts = [self._read_summary(meta, layer).keys for meta in self._metas]
            self._lowbit[layer] = join_lowbit(parts, self._model)
        return self._lowbit[layer]

    def packed_summary(self, layer: int) -> PackedLayer:
        """Layer `layer`'s summaries over the matched prefix with their codes still packed, every
        block's side by side (for a device to unpack and score in one op: engine_adapter/runner/
        chunk_mass.py `device_keys`). Asking for layer 0 first starts a thread that reads and
        verifies the next layers' records ahead, as `key_summary` does.

        Raises:
            InvalidInputError: layer out of range, or blocks of unlike geometry (use `key_summary`).
        """
        self._check_layer(layer)
        if self._packed_ahead is None and layer == 0 and self.num_layers > 1 and self._metas:
            self._packed_ahead = LayersAhead(self._packed_layer, self.num_layers)
        if self._packed_ahead is not None and layer >= self._packed_next:
            self._packed_next = layer + 1
            return self._packed_ahead.get(layer)
        return self._packed_layer(layer)

    def _packed_layer(self, layer: int) -> PackedLayer:
        return join_packed([self._verified_summary(meta, layer) for meta in self._metas])

    def read_layer(self, layer: int, chunks: Sequence[int], out: Array | None = None) -> LayerSlice:
        """Chunks `chunks` of `layer`: positions ascending, kv (2, kv_heads, n, head_dim), written
        into `out` when given (of that shape and the model's dtype: e.g. a page-locked buffer the
        device copies from next, so the host copies every byte once).

        Per block, the layer record is read whole when every chunk is wanted (`reads_whole`),
        else as its header (read once per load) and the chunks' byte ranges.

        Raises:
            InvalidInputError: `out` of another shape or dtype.
        """
        self._check_layer(layer)
        wanted = check_chunks(chunks, self.matched_tokens // self.chunk_tokens)
        per_block = self._metas[0].chunks_per_layer if self._metas else 1
        chosen = np.asarray(wanted, dtype=np.int64)
        # sorted: each block's chunks are one slice (no scan of every chunk per block)
        bounds = np.searchsorted(chosen // per_block, np.arange(len(self._metas) + 1))
        c, model = self.chunk_tokens, self._model
        shape = (2, model.num_kv_heads, len(chosen) * c, model.head_dim)
        if out is not None and (out.shape != shape or out.dtype != model.np_dtype):
            raise InvalidInputError(
                f"out must be {model.dtype} of shape {shape}, got {out.dtype} {out.shape}"
            )
        kv = np.empty(shape, model.np_dtype) if out is None else out
        starts: list[Array] = [np.zeros(0, np.int64)]
        for block_index, meta in enumerate(self._metas):
            a, b = int(bounds[block_index]), int(bounds[block_index + 1])
            if a < b:  # each block's chunks go straight to their slice: one copy of the KV
                local = chosen[a:b] - block_index * per_block
                self._read_block_layer(meta, block_index, layer, local.tolist(), kv[:, :, a * c : b * c])
                starts.append(meta.start + local * meta.chunk_tokens)
        self._layers_read.add(layer)
        self.delivered_tokens += kv.shape[2]
        positions = (np.concatenate(starts)[:, None] + np.arange(c, dtype=np.int64)).reshape(-1)
        return LayerSlice(positions, kv)

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
            later, self._promote_later = self._promote_later, []
        for meta, index, data in later:
            if meta.key not in self._lost:
                self._index.promote(meta, index, data)
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

    def _read_block_layer(
        self, meta: BlockMeta, block_index: int, layer: int, mine: list[int], into: Array
    ) -> None:
        """Sorted local chunks `mine` of one block's layer record, copied into `into`
        (2, kv_heads, len(mine) * chunk_tokens, head_dim)."""
        try:
            chunks = self._layer_chunks(meta, block_index, layer, mine)
        except GeometryError as exc:
            self._lose(meta, "geometry_mismatches")
            raise GeometryError(f"block {meta.key.hex()}: {exc}") from exc
        except ChecksumError as exc:
            self._lose(meta, "checksum_failures")
            raise ChecksumError(f"block {meta.key.hex()}: {exc}") from exc
        if chunks is None:
            self._lose(meta, "chunk_misses")
            raise NotFoundError(f"block {meta.key.hex()}: the record of layer {layer} is in no tier")
        _, heads, _, dim = into.shape
        joined = chunks[0] if len(chunks) == 1 else np.concatenate(chunks)  # (n, 2, heads, c, dim)
        n, c = joined.shape[0], joined.shape[3]
        into.reshape(2, heads, n, c, dim)[...] = joined.transpose(1, 2, 0, 3, 4)  # splits an axis: a view

    def _layer_chunks(
        self, meta: BlockMeta, block_index: int, layer: int, mine: list[int]
    ) -> list[Array] | None:
        """Chunks `mine` as runs of (n, 2, kv_heads, c, head_dim) arrays, in order; None: in no tier."""
        index, fetcher = meta.record_index(layer, 0), self._fetcher
        if reads_whole(len(mine), meta.chunks_per_layer):
            found = fetcher.whole_records(meta, [index], self._model)
            if found is None:
                return None
            geometry = layer_geometry(meta, layer, self._model)
            header, chunks = decode_layer_record(
                found[0].data, meta.chunk_id(index), found[0].trusted, geometry=geometry
            )
            fetcher.promote(meta, index, found[0], header, chunks)
            self._count_read(len(found[0].data))
            return [chunks[mine]]
        if self._raw_records and (block_index, layer) not in self._headers:  # header and chunks at once
            raw = read_raw_runs(fetcher, meta, index, mine, self._model)
            if raw is not None:
                self._headers[(block_index, layer)] = raw.head
                self._count_read(raw.nbytes)
                if raw.runs is not None:
                    return raw.runs
                self._raw_records = False  # compressed: this load reads by the header from now on
        for _attempt in range(2):  # a cached header's tier may have dropped the record since
            head = self._headers.get((block_index, layer))
            if head is None:
                head = read_header(fetcher, meta, index, self._model)
                if head is None:
                    return None
                self._headers[(block_index, layer)] = head
                self._count_read(head.header.size)
            got = read_chunk_runs(fetcher, meta, index, head, mine)
            if got is None:
                self._headers.pop((block_index, layer), None)
                continue
            runs, nbytes = got
            self._count_read(nbytes)
            return [run for _, run in runs]
        return None

    def _read_summary(self, meta: BlockMeta, layer: int) -> DecodedSummary:
        """One summary record, as `_verified_summary`, its codes unpacked."""
        packed = self._verified_summary(meta, layer)
        codes = unpack_codes(packed.codes, packed.bits, packed.shape)
        return DecodedSummary(
            packed.record_id, LowBitKeys(codes, packed.low, packed.step, packed.bits, packed.group_tokens)
        )

    def _verified_summary(self, meta: BlockMeta, layer: int) -> PackedSummary:
        """One summary record, fastest tier first, verified (codes packed); promoted to memory from a
        slower tier when the load closes."""
        index = meta.record_index(layer)
        if self._finish_summaries is not None:  # a block stored just now may not have them yet
            self._finish_summaries(meta.key)
        for tier in self._fetcher.tiers.all:
            data = self._summary_record(tier, meta, layer)
            if data is None:
                continue
            try:
                summary = verify_summary(data, meta.chunk_id(index), summary_geometry(meta, self._model))
            except ChecksumError as exc:
                if self._fetcher.refuse_remote(tier, meta, exc):
                    continue  # a miss: the remote tier is the last one
                geometry = isinstance(exc, GeometryError)
                self._lose(meta, "geometry_mismatches" if geometry else "checksum_failures")
                error = GeometryError if geometry else ChecksumError
                raise error(f"block {meta.key.hex()}, summary of layer {layer}: {exc}") from exc
            self._count_read(len(data))
            self._counters.add_many({f"summary_hits.{tier.name}": 1, f"bytes_read.{tier.name}": len(data)})
            if tier is not self._fetcher.tiers.memory:
                with self._lock:
                    self._promote_later.append((meta, index, bytes(data)))
            return summary
        self._lose(meta, "chunk_misses")
        raise NotFoundError(f"block {meta.key.hex()}: the summary of layer {layer} is in no tier")

    def _summary_record(self, tier: Tier, meta: BlockMeta, layer: int) -> bytes | memoryview | None:
        """Layer `layer`'s summary record of `meta` as `tier` holds it (None: not there).

        The first request for a block reads every layer's summary from the tier in one call (one
        transaction, adjacent values: the prefill asks for layer 0, then 1, ... within
        milliseconds); each is handed out once, then dropped. One call per record cost 480 reads
        for a 4,096-token prefix (issue #27, item 5).
        """
        cache_key = (tier.name, meta.key)
        with self._lock:
            records = self._summary_records.get(cache_key)
        if records is None:
            records = [None] * meta.num_layers
            with contextlib.suppress(KVSieveError):  # an unreachable remote tier is a miss here
                wanted = [meta.record_index(other) for other in range(meta.num_layers)]
                records = [None if d is None else bytes(d) for d in tier.get_chunks(meta, wanted)]
            with self._lock:
                records = self._summary_records.setdefault(cache_key, records)
        with self._lock:
            data, records[layer] = records[layer], None
        return data

    def _count_read(self, nbytes: int) -> None:
        with self._lock:  # the reader thread counts summaries while the caller counts chunks
            self.bytes_read += nbytes

    def _lose(self, meta: BlockMeta, counter: str) -> None:
        with self._lock:
            self._lost.add(meta.key)
        self._counters.add(counter)
        self._fetcher.forget(meta.key)
        self._index.forget(meta.key)
