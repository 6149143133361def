"""Whole packed blocks copied straight into the caller's array: a sidecar's load into an arena.

The sidecar hands a co-located client its KV in a shared-memory arena, each token at the slot
of its position (kvstore/server/chunks.py). Read as chunks, a full load of packed blocks was
copied three times on the way there: `pread` out of the page cache, the chunks of every layer
into one array per block, that array into the arena. Measured in the sidecar, a 2,048-token
SmolLM2 prefix (47 MB) after a restart: the `preadv` 12.8 ms, the array (fresh memory) 10 ms,
the arena 4.8 ms, per-chunk Python several more (docs/performance.md, issue 47 item 4).

Here each block is copied once, from where it lies into its slots of the arena:

- the memory tier's pack (trusted: this process verified or wrote it), or else
- the disk tier's pack where it lies in LMDB's map, when the page cache holds every page of it
  (kvstore/tiers/disk/resident.py): no read of it into memory of ours. Its table and headers are
  checked before the copy (they say where the chunks lie), the checksum of its records after
  it, over the very pages just copied: a pack changed under the map before or during the copy
  fails it, and the block is reported only once it passed. Such a read promotes nothing: the
  page cache holds the block, and a copy of it in the memory tier would be the second copy this
  path exists to avoid (a block the page cache has lost is read, verified and promoted as ever);
- else the pack as every full load reads it (`pack_view`: read, verified, promoted), copied from
  memory's copy.

Each block is one strided copy of every layer into its slots.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from kvstore.errors import ChecksumError
from kvstore.format.block_meta import BlockMeta
from kvstore.format.chunk import GeometryError
from kvstore.format.layer_pack import parse_table, split_pack
from kvstore.load.fetch import RecordFetcher, WholePack
from kvstore.load.plan import LoadPlan
from kvstore.load.read_layered import layer_units_view
from kvstore.load.read_packed import PackView, held_view, pack_view, raw_pack_view
from kvstore.model import ModelSpec
from kvstore.stats import Counters
from kvstore.values import Array

if TYPE_CHECKING:  # the thin client imports this module's `Placed`: never the store's index
    from kvstore.index.store_index import StoreIndex

#: Views of packs read in place kept (each a few hundred bytes: no bytes of the pack).
_MAX_VIEWS = 1 << 14


class Placed(NamedTuple):
    """One block copied into the caller's array, at the slots of its positions."""

    block_index: int
    positions: Array  # (block tokens,) int64, consecutive
    tier: str
    nbytes: int  # encoded bytes read from `tier`


class PackPlacer:
    """Places the whole packs of load plans into arrays; see module docstring. Thread-safe.

    Args:
        fetcher: the store's layer-record fetcher (memory's packs, the tiers, promotion).
        index: told which blocks were lost (a corrupt or missing block is forgotten).
        counters: the store's counters (`in_place_reads`: blocks copied from the page cache).
        in_place: whether a block the page cache holds is copied from there (`StoreConfig.read_in_place`);
            False reads it first, as every full load does.
    """

    def __init__(self, fetcher: RecordFetcher, index: StoreIndex, counters: Counters, in_place: bool) -> None:
        self._fetcher, self._index, self._counters, self._in_place_on = fetcher, index, counters, in_place
        # The view of each pack read in place, by block, with the records checksum and table it was
        # checked with: its headers are not compared again while the table names that checksum
        # (their bytes are the records', checked after every copy: other bytes fail it).
        self._views: dict[tuple[bytes, int], tuple[int, tuple[int, ...], PackView]] = {}

    def place(
        self, plan: LoadPlan, model: ModelSpec, out: Array, prefetch: Callable[[int], None]
    ) -> Iterator[Placed | None]:
        """Each block of `plan` (every one a whole pack) copied into `out` (layers, 2, kv_heads,
        slots, head_dim) at the slots of its positions, yielded once it is there and verified. A
        lost, corrupt or mismatched block yields None, is forgotten, and ends it (its slots may
        hold part of it: the caller reports none of them). `prefetch(i)`: block i on must be read
        from a tier (readahead)."""
        for block_index, meta in enumerate(plan.blocks):
            try:
                placed = self._place(meta, block_index, model, out, prefetch)
                failure = "chunk_misses" if placed is None else ""
            except GeometryError:
                placed, failure = None, "geometry_mismatches"
            except ChecksumError:
                placed, failure = None, "checksum_failures"
            if placed is None:
                self._counters.add(failure)
                self._views.pop((meta.key, meta.layout_version), None)
                self._fetcher.forget(meta.key)
                self._index.forget(meta.key)
                yield None
                return
            yield placed

    def _place(
        self, meta: BlockMeta, block_index: int, model: ModelSpec, out: Array, prefetch: Callable[[int], None]
    ) -> Placed | None:
        """One block from memory, else in place from the page cache, else read (`pack_view`)."""
        fetcher = self._fetcher
        view = held_view(fetcher, meta, block_index, model)
        if view is not None:
            name = fetcher.tiers.memory.name
            self._counters.add_many({f"chunk_hits.{name}": 1, f"bytes_read.{name}": len(view.data)})
            return _copied(view, out, len(view.data))
        for tier in fetcher.tiers.local_durable if self._in_place_on else ():
            in_place = getattr(tier, "value_in_place", None)
            if in_place is None:
                continue
            with in_place(meta, meta.pack_index) as data:
                placed = (
                    None if data is None else self._in_place(meta, block_index, model, out, data, tier.name)
                )
            if placed is not None:
                return placed
        prefetch(block_index)
        view = pack_view(fetcher, meta, block_index, model)
        return None if view is None else _copied(view, out, view.nbytes)

    def _in_place(
        self, meta: BlockMeta, block_index: int, model: ModelSpec, out: Array, data: memoryview, tier: str
    ) -> Placed | None:
        """Copy a pack that lies in the page cache into `out`, then check its records' checksum
        there; None (nothing counted) if its records are not raw ones of one size.

        Raises:
            ChecksumError: its table, a header or its records fail their checks (GeometryError:
                another geometry than `meta` and `model` imply).
        """
        table = parse_table(data, meta.chunk_id(meta.pack_index), meta.num_layers)
        if len(data) != table.total_bytes:
            raise ChecksumError(f"layer pack is {len(data)} bytes, its table says {table.total_bytes}")
        block, offsets = (meta.key, meta.layout_version), tuple(table.offsets)
        kept = self._views.get(block)
        known = kept is not None and kept[:2] == (table.records_checksum, offsets)
        if kept is not None and known:
            view: PackView | None = kept[2]._replace(block_index=block_index, data=data, tier=tier)
        else:
            parts = [data[a:b] for a, b in map(table.span, range(meta.num_layers))]
            pack = WholePack(data, parts, table.offsets, tier, False)
            view = raw_pack_view(self._fetcher, meta, block_index, model, pack)
        if view is None:
            return None
        placed = _copied(view, out, len(data))
        split_pack(data, table)  # the records' checksum, of the bytes just copied
        if not known:
            if len(self._views) >= _MAX_VIEWS:
                self._views.clear()
            self._views[block] = (table.records_checksum, offsets, view._replace(data=memoryview(b"")))
        self._counters.add_many(
            {f"chunk_hits.{tier}": 1, f"bytes_read.{tier}": len(data), "in_place_reads": 1}
        )
        return placed


def _copied(view: PackView, out: Array, nbytes: int) -> Placed:
    """Copy every layer's chunks of `view` into `out` at the slots of its positions (consecutive
    from the first): one strided copy, on this thread. Split in two threads (`copy_pairs`, as
    other loads copy) it measured slower here: 12-22 ms against 8.5-13.6 ms a 47 MB load in the
    sidecar, the machine's 2 cores shared with other jobs."""
    layers, (two, heads, chunk_tokens, dim) = out.shape[0], view.chunk_shape
    chunks, item = view.num_chunks, view.dtype.itemsize
    run = chunk_tokens * dim * item  # a chunk's K or V of one head
    src: Array = np.ndarray(
        (layers, chunks, two, heads, chunk_tokens, dim), view.dtype, view.data, view.first,
        (view.layer_stride, two * heads * run, heads * run, run, dim * item, item),
    )  # fmt: skip
    start = int(view.positions[0])
    slots = out[:, :, :, start : start + chunks * chunk_tokens]
    dest = layer_units_view(slots, True, layers, chunks)  # (layers, chunks, 2, heads, c, dim)
    np.copyto(dest, src)
    return Placed(view.block_index, view.positions, view.tier, nbytes)
