"""The key summaries of a layer-by-layer load: read once per block, handed out a layer at a time.

A query-aware load scores every layer's chunks against that layer's summaries over the whole
prefix (kvstore/format/key_summary.py: one record per block and layer). Verified one record at a
time, that was a Python call per block and layer: 2,048 at 16k tokens of an 8B-shaped model,
0.89 s of a 1.24 s warm load on an H200's host (../shared/device/runs/2026-11-28/profiles.txt).

Here, where memory holds every summary of the prefix (a warm prefix: what the store wrote, or
promoted after verifying it), a block's records are located once per load (one tier call for all
its layers, the first record's header parsed and its identity checked), and each layer is one
stack of the blocks' records: the layer's codes, offsets and steps are views of it
(`packed_summary`: no Python per block beyond a buffer view). Memory is trusted as every read of
it is. Otherwise each record is read from the fastest tier holding it and verified by its
checksum, identity and geometry (`verified`); one read from a slower tier is promoted to memory
when the load closes.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvstore.errors import ChecksumError, KVSieveError, NotFoundError
from kvstore.format.block_meta import BlockMeta
from kvstore.format.chunk import GeometryError
from kvstore.format.key_summary import (
    SUMMARY_HEADER_BYTES,
    PackedSummary,
    summary_record_bytes,
    verify_summary,
)
from kvstore.format.layered_block import summary_geometry
from kvstore.load.fetch import RecordFetcher
from kvstore.load.summaries import PackedLayer, join_packed
from kvstore.model import ModelSpec
from kvstore.stats import Counters
from kvstore.tiers.base import BatchTier, Tier

#: Encodes block `key`'s summaries now if a Store deferred them (no-op otherwise).
FinishSummaries = Callable[[bytes], object]
#: Forgets a block whose record failed (`meta`, the counter to add).
Lose = Callable[[BlockMeta, str], None]
#: Promotes a verified record read from a slower tier to memory (`StoreIndex.promote`).
Promote = Callable[[BlockMeta, int, bytes], object]


class SummaryReader:
    """A load's summary records; see module docstring. Thread-safe (a reader thread reads ahead).

    Args:
        fetcher: the store's record fetcher (its tiers).
        metas: the load's blocks, in prefix order.
        model: the model (geometry every record must have).
        counters: the store's counters.
        lose: forgets a block whose record failed its checks.
        promote: keeps a verified record of a slower tier in memory.
        count_read: adds bytes to the load's `bytes_read`.
        finish_summaries: encodes a just-stored block's deferred summaries.
    """

    def __init__(
        self, fetcher: RecordFetcher, metas: Sequence[BlockMeta], model: ModelSpec, counters: Counters,
        lose: Lose, promote: Promote, count_read: Callable[[int], None],
        finish_summaries: FinishSummaries | None = None,
    ) -> None:  # fmt: skip
        self._fetcher, self._metas, self._model = fetcher, list(metas), model
        self._promote = promote
        self._counters, self._lose, self._count_read = counters, lose, count_read
        self._finish = finish_summaries
        self._lock = threading.Lock()
        self._held: list[list[memoryview]] | None = None  # per block, every layer's record in memory
        self._held_known = False  # whether `_held` was looked for
        self._first: PackedSummary | None = None  # block 0's layer 0, parsed: the geometry of all
        # (tier, block key): every layer's summary record, read at once (`_record`)
        self._records: dict[tuple[str, bytes], list[Any]] = {}
        # records read from a slower tier, promoted to memory when the load closes: off the
        # prefill's path (480 promotions of a 4,096-token prefix cost ~40 ms of a core there)
        self._promote_later: list[tuple[BlockMeta, int, bytes]] = []

    def packed(self, layer: int) -> PackedLayer:
        """Layer `layer`'s summaries over the prefix, codes packed, blocks side by side.

        Raises:
            ChecksumError, GeometryError, NotFoundError: a record failed or is in no tier (its block
                is forgotten).
            InvalidInputError: blocks of unlike geometry.
        """
        held = self._held_records()
        if held is not None and self._first is not None:
            return _stacked_layer(held, layer, self._first, self._counters, self._count_read)
        return join_packed([self.verified(meta, layer) for meta in self._metas])

    def verified(self, meta: BlockMeta, layer: int) -> PackedSummary:
        """One summary record, fastest tier first, verified (codes packed); promoted to memory from a
        slower tier when the load closes (`promote_pending`)."""
        index = meta.record_index(layer)
        if self._finish is not None:  # a block stored just now may not have them yet
            self._finish(meta.key)
        for tier in self._fetcher.tiers.all:
            data = self._record(tier, meta, layer)
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

    def promote_pending(self, lost: set[bytes]) -> None:
        """Promote the records read from slower tiers to memory (those of `lost` blocks excepted)."""
        with self._lock:
            later, self._promote_later = self._promote_later, []
        for meta, index, data in later:
            if meta.key not in lost:
                self._promote(meta, index, data)

    def _held_records(self) -> list[list[memoryview]] | None:
        """Every layer's record of every block, where memory holds them all (else None); looked for
        once per load, block 0's first record parsed and every block's first identity checked."""
        with self._lock:
            if self._held_known:
                return self._held
        held = self._find_held()
        with self._lock:
            self._held, self._held_known = held, True
        return held

    def _find_held(self) -> list[list[memoryview]] | None:
        memory, model = self._fetcher.tiers.memory, self._model
        if not self._metas:
            return None
        size = summary_record_bytes(self._metas[0].num_tokens, model.num_kv_heads, model.head_dim)
        held: list[list[memoryview]] = []
        for meta in self._metas:
            if self._finish is not None:
                self._finish(meta.key)
            found = memory.get_chunks(meta, [meta.record_index(layer) for layer in range(meta.num_layers)])
            records = [r for r in found if r is not None and len(r) == size]
            if len(records) != len(found):
                return None
            held.append(records)
        try:  # memory is trusted; a block's identity and the geometry are still checked once
            first = verify_summary(
                held[0][0], self._metas[0].chunk_id(0), summary_geometry(self._metas[0], model)
            )
            for meta, block in zip(self._metas, held, strict=True):
                verify_summary(block[0], meta.chunk_id(0), summary_geometry(meta, model))
        except ChecksumError:
            return None  # read them one by one: that path forgets the block and raises
        self._first = first
        return held

    def _record(self, tier: Tier, meta: BlockMeta, layer: int) -> bytes | memoryview | None:
        """Layer `layer`'s summary record of `meta` as `tier` holds it (None: not there).

        The first request for a block reads every layer's summary from the tier in one call (one
        transaction, adjacent values: the prefill asks for layer 0, then 1, ... within
        milliseconds), and from the local disk with it those of every later block of the load that
        memory does not hold (`BatchTier`: LMDB reads their runs in parallel); each is handed out
        once, then dropped. One call per record cost 480 reads for a 4,096-token prefix (issue #27,
        item 5). A record asked for again (a layer read out of order, then again by the reader
        thread) is read again on its own: handed out is not absent (taken for absent, it made the
        load forget a good block).
        """
        cache_key = (tier.name, meta.key)
        with self._lock:
            records = self._records.get(cache_key)
        if records is None:
            local = tier in self._fetcher.tiers.local_durable
            read = self._read_batch(tier, meta, layer) if isinstance(tier, BatchTier) and local else {}
            records = read.get(meta.key) or self._read_all(tier, meta)
            with self._lock:
                for key, found in read.items():
                    self._records.setdefault((tier.name, key), found)
                records = self._records.setdefault(cache_key, records)
        with self._lock:
            data, records[layer] = records[layer], _TAKEN
        if data is _TAKEN:
            return self._read_all(tier, meta, [layer])[0]
        return data

    def _read_batch(self, tier: BatchTier, meta: BlockMeta, layer: int) -> dict[bytes, list[Any]]:
        """Every layer's summary records of `meta` and of the load's later blocks that neither memory
        holds (layer `layer`'s record) nor this reader has read from `tier`, by block key."""
        keys = [m.key for m in self._metas]
        memory, later = self._fetcher.tiers.memory, self._metas[keys.index(meta.key) :]
        with self._lock:
            unread = [m for m in later if (tier.name, m.key) not in self._records]
        wanted = []
        for other in unread:
            if self._finish is not None and other is not meta:
                self._finish(other.key)  # a block stored just now: memory holds its summaries then
            if other is meta or memory.get_chunks(other, [other.record_index(layer)])[0] is None:
                wanted.append(other)
        with contextlib.suppress(KVSieveError):  # an unreachable remote tier is a miss here
            got = tier.get_many([(m, [m.record_index(i) for i in range(m.num_layers)]) for m in wanted])
            return {m.key: _kept(tier.name, found) for m, found in zip(wanted, got, strict=True)}
        return {}

    def _read_all(self, tier: Tier, meta: BlockMeta, layers: Sequence[int] | None = None) -> list[Any]:
        """Summary records `layers` (default all) of `meta` from `tier`, None where it has none."""
        wanted = range(meta.num_layers) if layers is None else layers
        with contextlib.suppress(KVSieveError):  # an unreachable remote tier is a miss here
            return _kept(tier.name, tier.get_chunks(meta, [meta.record_index(layer) for layer in wanted]))
        return [None] * len(wanted)


def _kept(tier: str, found: Sequence[memoryview | None]) -> list[Any]:
    """Records as this reader keeps them: memory's copied out (the tier may evict and reuse their
    bytes), the other tiers' as they are (copies of their own: a disk read, a Redis reply)."""
    copy = tier == "memory"
    return [None if d is None else bytes(d) if copy else d for d in found]


#: A record `_record` handed out already (read again if asked again).
_TAKEN: Any = object()


def _stacked_layer(
    held: list[list[memoryview]], layer: int, first: PackedSummary, counters: Counters,
    count_read: Callable[[int], None],
) -> PackedLayer:  # fmt: skip
    """Layer `layer`'s records of every block stacked (one copy), codes and sides viewed in place."""
    rows = np.stack([np.frombuffer(records[layer], np.uint8) for records in held])
    heads, groups, dim = first.low.shape
    codes_at = SUMMARY_HEADER_BYTES
    side = heads * groups * dim * 2
    low_at = codes_at + len(first.codes)
    codes = rows[:, codes_at:low_at]
    low = rows[:, low_at : low_at + side].view("<f2").reshape(len(held), heads, groups, dim)
    step = rows[:, low_at + side : low_at + 2 * side].view("<f2").reshape(len(held), heads, groups, dim)
    nbytes = int(rows.nbytes)
    count_read(nbytes)
    counters.add_many({"summary_hits.memory": len(held), "bytes_read.memory": nbytes})
    return PackedLayer(codes, low, step, first.bits, first.shape, first.group_tokens)
