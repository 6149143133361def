"""Reading a layered block's layer records from the tiers: whole, or by byte ranges.

Fastest tier first (memory, then the disk, then the shared remote tier). What comes
from memory is trusted (this process wrote or verified it); everything else is
verified by the caller (kvstore/load/read_layered.py, kvstore/load/layer_by_layer.py) before use,
and a record read whole from a slower tier is then promoted to memory (`promote`).
Ranges are never promoted: memory holds whole records only, and a range is not one.
A remote record that fails its header check is a miss, counted and deleted remotely
(its key is a content hash: the value is wrong for every reader). Every header is checked
against the geometry the block's metadata and the model imply (`layer_geometry`), never
trusted: a record of another chunk size, chunk count, layer, dtype or shape is refused with
`GeometryError` (a local one) or is a miss counted in `geometry_mismatches` (a remote one).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

from kvstore.errors import ChecksumError, KVSieveError
from kvstore.format.block_meta import BlockMeta
from kvstore.format.chunk import GeometryError
from kvstore.format.layer_record import LayerGeometry, LayerHeader, parse_header, raw_from_chunks
from kvstore.format.layered_block import layer_geometry
from kvstore.model import ModelSpec
from kvstore.stats import Counters
from kvstore.tiers.base import Tier
from kvstore.tiers.stack import TierStack
from kvstore.values import Array

if TYPE_CHECKING:
    from kvstore.index.store_index import StoreIndex


_MAX_HEADERS = 1 << 16  # parsed headers kept (a few hundred bytes each)


class Fetched(NamedTuple):
    """One record read whole: its bytes, the tier it came from, whether it needs no checksum."""

    data: memoryview
    tier: str
    trusted: bool


class FetchedRanges(NamedTuple):
    """Byte ranges of one record, all from `tier`."""

    data: list[memoryview]
    tier: Tier
    trusted: bool


class RecordFetcher:
    """Whole-record and ranged reads of layer records from one store's tiers; see module docstring."""

    def __init__(self, tiers: TierStack, index: StoreIndex, counters: Counters) -> None:
        self.tiers, self._index, self._counters = tiers, index, counters
        # Headers of records memory holds, parsed once: memory holds the raw encoding of a record,
        # the same bytes whenever it is promoted again, under a key that names block, layout, index.
        self._headers: dict[tuple[bytes, int, int], LayerHeader] = {}

    def known_header(
        self, meta: BlockMeta, index: int, fetched: Fetched, geometry: LayerGeometry
    ) -> LayerHeader | None:
        """The parsed header of a record memory holds (parsed and kept on first use), else None.
        A kept header is used only while it describes `geometry`.

        Raises:
            ChecksumError: the record fails its header checks (GeometryError: of its geometry).
        """
        if not fetched.trusted:
            return None
        key = (meta.key, meta.layout_version, index)
        header = self._headers.get(key)
        if header is None or header.geometry != geometry:
            header = parse_header(fetched.data, meta.chunk_id(index), geometry)
            self._keep(meta, index, header)
        return header

    def _keep(self, meta: BlockMeta, index: int, header: LayerHeader) -> None:
        if len(self._headers) >= _MAX_HEADERS:
            self._headers.clear()
        self._headers[(meta.key, meta.layout_version, index)] = header

    def forget(self, key: bytes) -> None:
        """Drop the kept headers of block `key` (the store dropped the block). Mutates."""
        for kept in [k for k in self._headers if k[0] == key]:
            self._headers.pop(kept, None)

    def refuse_remote(self, tier: Tier, meta: BlockMeta, exc: ChecksumError) -> bool:
        """A record of `tier` failed its checks with `exc`. If `tier` is the shared remote tier,
        the value is a miss: counted (`geometry_mismatches` too for a GeometryError) and the
        block deleted there. Returns whether it was (else the caller raises `exc`)."""
        remote = self.tiers.remote
        if remote is None or tier is not remote.tier:
            return False
        if isinstance(exc, GeometryError):
            self._counters.add("geometry_mismatches")
        remote.tier.count_corrupt()
        with contextlib.suppress(KVSieveError):
            remote.tier.delete_block(meta.key)
        return True

    def all_in_memory(self, meta: BlockMeta, indices: Sequence[int]) -> bool:
        """Whether memory holds every record `indices` (then reading them whole copies nothing)."""
        return all(self.tiers.memory.has_chunk(meta.key, i) for i in indices)

    def whole_records(
        self, meta: BlockMeta, indices: Sequence[int], model: ModelSpec
    ) -> list[Fetched] | None:
        """Layer records `indices` of a block, fastest tier first; None if one is in no tier (a
        remote one whose header fails its checks, against `model` too, is in none)."""
        memory = self.tiers.memory
        found: dict[int, Fetched] = {}
        for index, data in zip(indices, memory.get_chunks(meta, indices), strict=True):
            if data is not None:
                found[index] = Fetched(data, memory.name, True)
        self._index.touch_memory(meta, found)
        for tier in self.tiers.durable:
            missing = [i for i in indices if i not in found]
            if not missing:
                break
            for index, data in zip(missing, self._get(tier, meta, missing), strict=True):
                if data is not None and self._remote_ok(tier, meta, index, data, model):
                    found[index] = Fetched(data, tier.name, False)
        tally: dict[str, int] = {}
        for fetched in found.values():
            for name, value in (
                (f"chunk_hits.{fetched.tier}", 1),
                (f"bytes_read.{fetched.tier}", len(fetched.data)),
            ):
                tally[name] = tally.get(name, 0) + value
        self._counters.add_many(tally)
        if len(found) < len(indices):
            return None
        return [found[i] for i in indices]

    def ranges(
        self, meta: BlockMeta, index: int, ranges: Sequence[tuple[int, int]], only: Tier | None = None
    ) -> FetchedRanges | None:
        """Byte ranges of record `index` from the fastest tier holding it (or from `only`)."""
        for tier in self.tiers.all if only is None else (only,):
            data = None
            with contextlib.suppress(KVSieveError):  # an unreachable remote tier is a miss here
                data = tier.get_ranges(meta, index, ranges)
            if data is None:
                continue
            if only is None:
                self._counters.add(f"chunk_hits.{tier.name}")
            self._counters.add(f"bytes_read.{tier.name}", sum(len(d) for d in data))
            return FetchedRanges(data, tier, tier is self.tiers.memory)
        return None

    def promote(
        self, meta: BlockMeta, index: int, fetched: Fetched, header: LayerHeader, chunks: Array
    ) -> None:
        """Copy a verified record read whole from a slower tier into memory (raw: no zstd on reads)."""
        if fetched.trusted:
            return
        raw = fetched.data if header.codec == "raw" else raw_from_chunks(header, chunks)
        if self._index.promote(meta, index, raw) and header.codec == "raw":
            # memory now holds these very bytes, whose header was just verified: the next
            # load of them parses nothing (a re-encoded record's header differs: parsed then)
            self._keep(meta, index, header)

    def _get(self, tier: Tier, meta: BlockMeta, indices: list[int]) -> list[memoryview | None]:
        if self.tiers.is_remote(tier):
            with contextlib.suppress(KVSieveError):
                return tier.get_chunks(meta, indices)
            return [None] * len(indices)
        return tier.get_chunks(meta, indices)

    def _remote_ok(self, tier: Tier, meta: BlockMeta, index: int, data: memoryview, model: ModelSpec) -> bool:
        """Local records are verified by the caller (a failure raises); a remote one that is not a
        layer record of this identity and geometry is a miss here (`refuse_remote`)."""
        if not self.tiers.is_remote(tier):
            return True
        try:
            parse_header(data, meta.chunk_id(index), layer_geometry(meta, index - meta.num_layers, model))
            return True
        except ChecksumError as exc:
            self.refuse_remote(tier, meta, exc)
            return False
