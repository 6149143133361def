"""BlockReader: a load's bytes, from the tiers to the caller.

It reads each planned block's chunks fastest tier first, verifies them (a block is
read whole before any of its chunks is yielded), promotes what it read from a slower
tier to memory, and starts the disk's readahead at the first chunk memory lacks. Which
chunks to read is planned apart (kvstore/load/plan.py); what to keep in memory the
index decides (kvstore/index/store_index.py).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from kvstore.config import StoreConfig
from kvstore.errors import ChecksumError
from kvstore.format.block_meta import BlockMeta
from kvstore.format.chunk import GeometryError, decode_chunk, encode_chunk
from kvstore.format.layered_block import stored_records
from kvstore.index.store_index import StoreIndex
from kvstore.load.ahead import LayersAhead
from kvstore.load.assemble import Destination
from kvstore.load.fetch import RecordFetcher, WholePack
from kvstore.load.place import PackPlacer
from kvstore.load.plan import LoadPlan
from kvstore.load.read_layered import load_units, reads_whole
from kvstore.load.read_packed import PackView, load_pack_units, pack_view, view_of_pack
from kvstore.load.stream import BlockStream
from kvstore.model import ModelSpec
from kvstore.stats import Counters
from kvstore.tiers.base import Tier
from kvstore.tiers.stack import TierStack
from kvstore.values import LoadedChunk

if TYPE_CHECKING:  # kvstore.tiers.remote.link imports redis: only a store with a remote tier loads it
    pass

#: Packs a full load's reader thread reads ahead of the block being viewed (each one block's bytes).
PACKS_AHEAD = 2


class BlockReader:
    """Verified chunk reads fastest tier first, with promotion; see module docstring. Thread-safe.

    Args:
        config: the store's configuration (its codec: memory holds raw chunks).
        index: told what was read (recency), what to promote, and what was lost.
        tiers: the store's tiers.
        counters: the store's counters.
    """

    def __init__(self, config: StoreConfig, index: StoreIndex, tiers: TierStack, counters: Counters) -> None:
        self._config = config
        self._index = index
        self.tiers = tiers
        self._counters = counters
        self.layer_records = RecordFetcher(tiers, index, counters)  # the layered layout's reads
        self._placer = PackPlacer(self.layer_records, index, counters, config.read_in_place)

    def read_blocks(self, plan: LoadPlan, model: ModelSpec) -> BlockStream:
        """Each planned block's chunks of `model`, verified whole before it is yielded. A block lost
        from every tier, corrupt, or whose records describe other geometry than its metadata and
        `model` (`geometry_mismatches`) yields None, is forgotten by the index (every local tier
        drops it), and ends the iteration. The caller may lend the stream a `Destination`."""
        stream = BlockStream()
        stream.blocks = self._read_blocks(plan, model, stream)
        whole = zip(plan.blocks, plan.chunks, strict=True)
        if plan.blocks and all(_whole_pack_planned(meta, units) for meta, units in whole):
            stream.views = lambda: self._read_views(plan, model)
            prefetch = _Prefetch(self.tiers.local_durable, plan).start
            stream.place = lambda out: self._placer.place(plan, model, out, prefetch)
        return stream

    def _read_views(self, plan: LoadPlan, model: ModelSpec) -> Iterator[PackView | None]:
        """`read_blocks` of a plan of whole packed blocks, each as a `PackView` (no copy of what
        memory holds; a slower tier's pack is read into memory's arena and kept there): a lost,
        corrupt or mismatched block yields None, is forgotten and ends it, as there. From the
        first block memory lacks on, each pack is read (and its records' checksum verified) on a
        thread of its own up to `PACKS_AHEAD` blocks ahead, while this one checks the headers and
        promotes the block before: the reads and the host's work overlap instead of taking turns."""
        prefetch = _Prefetch(self.tiers.local_durable, plan)
        ahead: LayersAhead[WholePack | None] | None = None
        first = 0
        try:
            for block_index, meta in enumerate(plan.blocks):
                if ahead is None and not self.layer_records.all_in_memory(meta, []):
                    prefetch.start(block_index)
                    ahead, first = self._packs_ahead(plan, model, block_index), block_index
                view, failure = self._view(meta, block_index, model, ahead, first)
                if view is None:
                    self._counters.add(failure)
                    self.layer_records.forget(meta.key)
                    self._index.forget(meta.key)
                    yield None
                    return
                yield view
        finally:
            if ahead is not None:
                ahead.stop()

    def _packs_ahead(self, plan: LoadPlan, model: ModelSpec, first: int) -> LayersAhead[WholePack | None]:
        """Blocks `first`.. of `plan` read whole (`RecordFetcher.whole_pack`) on a reader thread."""
        blocks, fetcher = plan.blocks[first:], self.layer_records
        return LayersAhead(lambda i: fetcher.whole_pack(blocks[i], model), len(blocks), PACKS_AHEAD)

    def _view(
        self, meta: BlockMeta, block_index: int, model: ModelSpec,
        ahead: LayersAhead[WholePack | None] | None, first: int,
    ) -> tuple[PackView | None, str]:  # fmt: skip
        """A block's view and, if there is none, the counter that says why."""
        fetcher = self.layer_records
        try:
            if ahead is None:
                view = pack_view(fetcher, meta, block_index, model)
            else:
                pack = ahead.get(block_index - first)  # raises what reading it raised
                view = None if pack is None else view_of_pack(fetcher, meta, block_index, model, pack)
            return view, "chunk_misses" if view is None else ""
        except GeometryError:
            return None, "geometry_mismatches"
        except ChecksumError:
            return None, "checksum_failures"

    def _read_blocks(
        self, plan: LoadPlan, model: ModelSpec, stream: BlockStream
    ) -> Iterator[list[LoadedChunk] | None]:
        prefetch = _Prefetch(self.tiers.local_durable, plan)
        for block_index, (meta, indices) in enumerate(zip(plan.blocks, plan.chunks, strict=True)):
            try:
                chunks = self._read_block(meta, block_index, indices, prefetch, model, stream.destination)
                failure = "chunk_misses" if chunks is None else ""
            except GeometryError:
                chunks, failure = None, "geometry_mismatches"
            except ChecksumError:
                chunks, failure = None, "checksum_failures"
            if chunks is None:  # this block and all after it become a miss
                self._counters.add(failure)
                self.layer_records.forget(meta.key)
                self._index.forget(meta.key)
                yield None
                return
            if stream.destination is not None:
                stream.destination.advance(sum(len(c.positions) for c in chunks))
            yield chunks

    def _read_block(
        self, meta: BlockMeta, block_index: int, units: list[int], prefetch: _Prefetch, model: ModelSpec,
        destination: Destination | None,
    ) -> list[LoadedChunk] | None:  # fmt: skip
        """The planned units of a block: its chunks, or a layered block's chunks of every layer
        (joined in `destination` when one is lent)."""
        if not meta.is_layered:
            return self.read_records(meta, block_index, indices=units, model=model, prefetch=prefetch)
        in_memory = all(self.tiers.memory.has_chunk(meta.key, i) for i in stored_records(meta, units))
        if not in_memory:
            prefetch.start(block_index)
        into = None if destination is None else destination.claim(len(units) * meta.chunk_tokens)
        if meta.is_packed and (in_memory or reads_whole(len(set(units)), meta.chunks_per_layer)):
            # the whole pack (`stored_records`: the pack is what memory holds): one copy per run
            return load_pack_units(self.layer_records, meta, block_index, units, model, into)
        return load_units(self.layer_records, meta, block_index, units, model, into)

    def read_records(
        self, meta: BlockMeta, block_index: int, indices: list[int], model: ModelSpec,
        prefetch: _Prefetch | None = None,
    ) -> list[LoadedChunk] | None:  # fmt: skip
        """Chunk records `indices` of a block, fastest tier first, verified and promoted to memory.
        Each chunk's header must hold the positions, layers, heads, head dim and dtype that `meta`
        and `model` imply (`BlockMeta.chunk_geometry`).

        Returns None if one is in no tier (a remote one that fails its checks is in none).
        Raises ChecksumError if a local one is corrupt (GeometryError: of other geometry).
        """
        found: dict[int, LoadedChunk] = {}
        tally: Counter[str] = Counter()
        memory = self.tiers.memory
        for index, data in zip(indices, memory.get_chunks(meta, indices), strict=True):
            if data is not None:
                found[index] = self._decode(meta, block_index, index, data, memory.name, tally, model)
        self._index.touch_memory(meta, found)
        if len(found) < len(indices) and prefetch is not None:
            prefetch.start(block_index)
        for tier in self.tiers.durable:
            missing = [i for i in indices if i not in found]
            if not missing:
                break
            promoted: list[tuple[int, bytes | memoryview]] = []
            for index, data in zip(missing, tier.get_chunks(meta, missing), strict=True):
                if data is None:
                    continue
                chunk = self._decode_durable(meta, block_index, index, data, tier, tally, model)
                if chunk is not None:
                    found[index] = chunk
                    promoted.append((index, self._raw(meta, index, chunk, data)))
            if promoted:  # one call into the index per block, whatever its chunks
                self._index.promote_many(meta, promoted)
        self._counters.add_many(tally)
        if len(found) < len(indices):
            return None
        return [found[i] for i in indices]

    def _decode(
        self, meta: BlockMeta, block_index: int, index: int, data: memoryview, tier: str,
        tally: Counter[str], model: ModelSpec,
    ) -> LoadedChunk:  # fmt: skip
        # Memory holds chunks this process encoded in immutable buffers: skip the checksum.
        trusted = tier == self.tiers.memory.name
        decoded = decode_chunk(data, meta.chunk_id(index), trusted, meta.chunk_geometry(index, model))
        tally[f"chunk_hits.{tier}"] += 1
        tally[f"bytes_read.{tier}"] += len(data)
        return LoadedChunk(block_index, index, decoded.positions, decoded.kv, tier, len(data))

    def _decode_durable(
        self, meta: BlockMeta, block_index: int, index: int, data: memoryview, tier: Tier,
        tally: Counter[str], model: ModelSpec,
    ) -> LoadedChunk | None:  # fmt: skip
        """Decode a chunk read from disk or the remote tier. A remote chunk that fails its
        checksum, identity or geometry is a miss, counted, and deleted remotely (its key is a
        content hash: the value is wrong for every reader). A local one raises ChecksumError."""
        try:
            return self._decode(meta, block_index, index, data, tier.name, tally, model)
        except ChecksumError as exc:
            if self.layer_records.refuse_remote(tier, meta, exc):
                return None
            raise

    def _raw(self, meta: BlockMeta, index: int, chunk: LoadedChunk, data: memoryview) -> bytes | memoryview:
        """What memory holds of a chunk read from a slower tier: raw (no zstd on the hot path)."""
        if self._config.codec == "raw":
            return data
        return encode_chunk(meta.chunk_id(index), chunk.positions, chunk.kv, chunk.kv.dtype.name, "raw")


def _whole_pack_planned(meta: BlockMeta, units: list[int]) -> bool:
    """Whether a plan reads every chunk of a packed block, in order (a full load of it)."""
    return meta.is_packed and units == list(range(meta.chunks_per_layer))


class _Prefetch:
    """Readahead for one load: at its first chunk that memory lacks, ask the disk tiers to
    read every remaining planned block in the background (see LmdbTier.prefetch)."""

    def __init__(self, tiers: Sequence[Tier], plan: LoadPlan) -> None:
        self._tiers = [t for t in tiers if hasattr(t, "prefetch")]
        self._plan: LoadPlan | None = plan

    def start(self, block_index: int) -> None:
        """Hint once, from `block_index` on; later calls do nothing."""
        plan, self._plan = self._plan, None
        if plan is None or len(plan.blocks) - block_index < 2:  # one block: nothing to overlap
            return
        rest = [
            (meta, stored_records(meta, units))
            for meta, units in zip(plan.blocks[block_index:], plan.chunks[block_index:], strict=True)
        ]
        for tier in self._tiers:
            tier.prefetch(rest)
