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

A packed block (layout v3) stores its layer records in one value, the pack
(kvstore/format/layer_pack.py). Callers still name layer records by their own index; the
fetcher reads the pack whole (a full load: one value per block) or reads its table once per
block and tier and shifts a layer record's ranges by the record's offset in the pack. A pack
is promoted whole, once every layer record of it has been verified.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

from kvstore.errors import ChecksumError, KVSieveError
from kvstore.format.block_meta import BlockMeta
from kvstore.format.chunk import GeometryError
from kvstore.format.layer_pack import PackTable, encode_pack, parse_table, split_pack, table_bytes
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
_MAX_TABLES = 1 << 14  # pack tables kept (per block and local tier, a few hundred bytes each)
_MAX_PENDING = 8  # packs whose layer records are being verified one by one (each holds views)


class Fetched(NamedTuple):
    """One record read whole: its bytes, the tier it came from, whether it needs no checksum."""

    data: memoryview
    tier: str
    trusted: bool


class WholePack(NamedTuple):
    """A packed block's pack read whole: its bytes, its layer records (views of them) and where
    each starts in it, where it came from."""

    data: memoryview
    parts: list[memoryview]
    offsets: list[int]
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
        # Pack tables of local tiers, verified once: memory holds the raw encoding of a pack and the
        # disk what this store wrote, both fixed under a key that names block and layout. The
        # remote tier's are read every time (another store may have written the value).
        self._tables: dict[tuple[str, bytes, int], PackTable] = {}
        # Verified raw layer records of packs read from a slower tier, by block, until all are in
        self._pending: dict[tuple[bytes, int], dict[int, tuple[bytes | memoryview, LayerHeader]]] = {}
        # Every header of a pack memory holds, verified together (a full load checks none again)
        self._packs: dict[tuple[bytes, int], list[LayerHeader]] = {}
        self._lock = threading.Lock()  # guards _tables and _pending (loads read blocks in threads)

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
        if header is None and (pack := self._packs.get(key[:2])) and index >= meta.num_layers:
            header = pack[index - meta.num_layers]  # kept with its pack (`keep_pack`)
        if header is None or header.geometry != geometry:
            header = parse_header(fetched.data, meta.chunk_id(index), geometry)
            self._keep(meta, index, header)
        return header

    def known_pack(self, meta: BlockMeta) -> list[LayerHeader] | None:
        """The headers of every record of the pack memory holds of `meta`, if all were verified
        together before (`keep_pack`): the same bytes whenever it is promoted, as for `known_header`."""
        return self._packs.get((meta.key, meta.layout_version))

    def keep_pack(self, meta: BlockMeta, headers: list[LayerHeader]) -> None:
        """Remember the verified headers of every record of the pack memory holds of `meta`."""
        with self._lock:
            if len(self._packs) >= _MAX_TABLES:
                self._packs.clear()
            self._packs[(meta.key, meta.layout_version)] = headers

    def _keep(self, meta: BlockMeta, index: int, header: LayerHeader) -> None:
        if len(self._headers) >= _MAX_HEADERS:
            self._headers.clear()
        self._headers[(meta.key, meta.layout_version, index)] = header

    def forget(self, key: bytes) -> None:
        """Drop the kept headers of block `key` (the store dropped the block). Mutates."""
        for kept in [k for k in self._headers if k[0] == key]:
            self._headers.pop(kept, None)
        with self._lock:
            for table in [k for k in self._tables if k[1] == key]:
                self._tables.pop(table, None)
            for pending in [k for k in self._pending if k[0] == key]:
                self._pending.pop(pending, None)
            for pack in [k for k in self._packs if k[0] == key]:
                self._packs.pop(pack, None)

    def refuse_remote(self, tier: Tier, meta: BlockMeta, exc: ChecksumError) -> bool:
        """A record of `tier` failed its checks with `exc`. If `tier` is the shared remote tier, the value
        is a miss: counted (`geometry_mismatches` too for a GeometryError), the block deleted there.
        Returns whether it was (else the caller raises `exc`)."""
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
        if meta.is_packed:
            return self.tiers.memory.has_chunk(meta.key, meta.pack_index)
        return all(self.tiers.memory.has_chunk(meta.key, i) for i in indices)

    def whole_records(
        self, meta: BlockMeta, indices: Sequence[int], model: ModelSpec
    ) -> list[Fetched] | None:
        """Layer records `indices` of a block, fastest tier first; None if one is in no tier (a
        remote one whose header fails its checks, against `model` too, is in none)."""
        if meta.is_packed:
            return self._whole_packed(meta, indices, model)
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
        tally: Counter[str] = Counter()
        for fetched in found.values():
            tally[f"chunk_hits.{fetched.tier}"] += 1
            tally[f"bytes_read.{fetched.tier}"] += len(fetched.data)
        self._counters.add_many(tally)
        if len(found) < len(indices):
            return None
        return [found[i] for i in indices]

    def ranges(
        self, meta: BlockMeta, index: int, ranges: Sequence[tuple[int, int]], only: Tier | None = None
    ) -> FetchedRanges | None:
        """Byte ranges of record `index` from the fastest tier holding it (or from `only`).

        Raises:
            ChecksumError: a local pack's table fails its checks (GeometryError: other geometry).
        """
        in_pack = meta.is_packed and index >= meta.num_layers
        for tier in self.tiers.all if only is None else (only,):
            data = None
            if in_pack:
                data = self._pack_ranges(tier, meta, index, ranges)
            else:
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
        """Copy a verified record read whole from a slower tier into memory (raw: no zstd on reads).
        A packed block's record waits for the others of its pack: the pack is promoted whole."""
        if fetched.trusted:
            return
        raw = fetched.data if header.codec == "raw" else raw_from_chunks(header, chunks)
        if meta.is_packed:
            self._promote_in_pack(meta, index, raw, header)
            return
        if self._index.promote(meta, index, raw) and header.codec == "raw":
            # memory now holds these very bytes, whose header was just verified: the next
            # load of them parses nothing (a re-encoded record's header differs: parsed then)
            self._keep(meta, index, header)

    # -- packed blocks (layout v3) ------------------------------------------------------------

    def whole_pack(self, meta: BlockMeta, model: ModelSpec) -> WholePack | None:
        """A packed block's whole pack, fastest tier first: memory's (trusted), else read whole from
        a durable tier, its table and the checksum of its records verified (a remote one whose table,
        records or a header fails its checks, against `model` too, is a miss). None if no tier
        holds it.

        Raises:
            ChecksumError: a local pack's table fails its checks (GeometryError: another layer count).
        """
        memory, pack = self.tiers.memory, meta.pack_index
        held = self.memory_pack(meta)
        if held is not None:
            self._counters.add_many(
                {f"chunk_hits.{memory.name}": 1, f"bytes_read.{memory.name}": len(held.data)}
            )
            return held
        for tier in self.tiers.durable:
            data = self._get(tier, meta, [pack])[0]
            if data is None:
                continue
            try:
                table = parse_table(data, meta.chunk_id(pack), meta.num_layers)
                parts = split_pack(data, table)
                if self.tiers.is_remote(tier):  # a miss, not an error, if any header is wrong
                    for layer, part in enumerate(parts):
                        geometry = layer_geometry(meta, layer, model)
                        parse_header(part, meta.chunk_id(meta.num_layers + layer), geometry)
            except ChecksumError as exc:
                if self.refuse_remote(tier, meta, exc):
                    continue
                raise
            self._counters.add_many({f"chunk_hits.{tier.name}": 1, f"bytes_read.{tier.name}": len(data)})
            return WholePack(data, parts, table.offsets, tier.name, False)
        return None

    def held_pack(self, meta: BlockMeta) -> WholePack | None:
        """The pack memory holds of a packed block, if all its headers were verified together before
        (`keep_pack`), as a `WholePack` of memory's own bytes; else None."""
        return self.memory_pack(meta) if self.known_pack(meta) is not None else None

    def memory_pack(self, meta: BlockMeta) -> WholePack | None:
        """The pack memory holds of `meta` with its verified table, touched as recently used, or None
        (nothing is counted: a full load counts the pack, a partial one the bytes it copies)."""
        memory = self.tiers.memory
        held = memory.get_chunks(meta, [meta.pack_index])[0]
        table = None if held is None else self._table(memory, meta, held)
        if held is None or table is None:
            return None
        self._index.touch_memory(meta, [meta.pack_index])
        parts = [held[a:b] for a, b in map(table.span, range(meta.num_layers))]
        return WholePack(held, parts, table.offsets, memory.name, True)

    def promote_pack(
        self, meta: BlockMeta, pack: WholePack, headers: Sequence[LayerHeader], chunks: Sequence[Array]
    ) -> None:
        """Copy a pack read whole from a slower tier, every record of it verified (`headers`, decoded
        `chunks`), into memory: the same bytes if every record is raw, else re-encoded raw. One
        promotion and one list of headers kept, whatever the layers (`known_header` looks there)."""
        if pack.trusted:
            return
        if all(h.codec == "raw" for h in headers):
            if self._index.promote(meta, meta.pack_index, pack.data):
                self.keep_pack(meta, list(headers))  # memory now holds these very bytes
            return
        raws = [raw_from_chunks(h, c) for h, c in zip(headers, chunks, strict=True)]
        self._index.promote(meta, meta.pack_index, encode_pack(meta.chunk_id(meta.pack_index), raws))

    def _whole_packed(
        self, meta: BlockMeta, indices: Sequence[int], model: ModelSpec
    ) -> list[Fetched] | None:
        """`whole_records` of a packed block: views of its whole pack when memory holds it or every
        layer is wanted, else each record's span (a few layers) from the fastest tier."""
        if len(indices) == meta.num_layers or self.all_in_memory(meta, indices):
            pack = self.whole_pack(meta, model)
            if pack is None:
                return None
            return [Fetched(pack.parts[i - meta.num_layers], pack.tier, pack.trusted) for i in indices]
        spans = [self.ranges(meta, i, [(0, 1 << 62)]) for i in indices]  # clipped to each record's span
        if any(s is None for s in spans):
            return None
        return [Fetched(s.data[0], s.tier.name, s.trusted) for s in spans if s is not None]

    def _pack_ranges(
        self, tier: Tier, meta: BlockMeta, index: int, ranges: Sequence[tuple[int, int]]
    ) -> list[memoryview] | None:
        """Byte ranges of layer record `index` of a packed block from `tier`: its pack's table (kept
        for a local tier), then the ranges shifted to the record's span (clipped at its end)."""
        table = self._table(tier, meta)
        if table is None:
            return None
        start, end = table.span(index - meta.num_layers)
        shifted = [(min(start + a, end), min(start + b, end)) for a, b in ranges]
        with contextlib.suppress(KVSieveError):  # an unreachable remote tier is a miss here
            return tier.get_ranges(meta, meta.pack_index, shifted)
        return None

    def _table(self, tier: Tier, meta: BlockMeta, data: memoryview | None = None) -> PackTable | None:
        """The verified table of a packed block's pack in `tier` (from `data`, its start, if read);
        None if the tier does not hold it (or a remote one fails its checks: a miss).

        Raises:
            ChecksumError: a local table fails its checks (GeometryError: another layer count).
        """
        key = (tier.name, meta.key, meta.layout_version)
        kept = self._tables.get(key)
        if kept is not None:
            return kept
        if data is None:
            got = None
            with contextlib.suppress(KVSieveError):  # an unreachable remote tier is a miss here
                got = tier.get_ranges(meta, meta.pack_index, [(0, table_bytes(meta.num_layers))])
            if got is None:
                return None
            self._counters.add(f"bytes_read.{tier.name}", len(got[0]))
            data = got[0]
        try:
            table = parse_table(data, meta.chunk_id(meta.pack_index), meta.num_layers)
        except ChecksumError as exc:
            if self.refuse_remote(tier, meta, exc):
                return None
            raise
        if not self.tiers.is_remote(tier):
            with self._lock:
                if len(self._tables) >= _MAX_TABLES:
                    self._tables.clear()
                self._tables[key] = table
        return table

    def _promote_in_pack(
        self, meta: BlockMeta, index: int, raw: bytes | memoryview, header: LayerHeader
    ) -> None:
        """Keep verified raw layer record `index` of a packed block; once every layer's is kept,
        promote the pack they make (raw) to memory."""
        block = (meta.key, meta.layout_version)
        with self._lock:
            records = self._pending.setdefault(block, {})
            records[index - meta.num_layers] = (raw, header)
            if len(records) < meta.num_layers:
                if len(self._pending) > _MAX_PENDING:  # loads that failed half-way left theirs
                    self._pending.pop(next(iter(self._pending)))
                return
            del self._pending[block]
        layers = [records[layer] for layer in range(meta.num_layers)]
        pack = encode_pack(meta.chunk_id(meta.pack_index), [raw for raw, _ in layers])
        if self._index.promote(meta, meta.pack_index, pack):
            for layer, (_, kept) in enumerate(layers):
                if kept.codec == "raw":  # memory now holds these very bytes (a re-encoded one's differ)
                    self._keep(meta, meta.num_layers + layer, kept)

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
