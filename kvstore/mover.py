"""BlockMover: the store's bytes, between the caller and the tiers.

It encodes new blocks and writes them (local durable tiers first, in one
transaction, then memory, then the shared remote tier's queue), reads and
verifies chunks fastest tier first, promotes what it read to memory, and learns
blocks that other sidecars put in the remote tier. What to keep and what to
evict it asks the index (kvstore/index.py); it never decides either.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, cast

import numpy as np

from importance.layout import importance_order
from kvstore.codec import ChunkId, decode_chunk, encode_chunk
from kvstore.config import StoreConfig
from kvstore.errors import ChecksumError, InvalidInputError, KVSieveError, StoreFullError, TierFullError
from kvstore.index import LoadPlan, StoreIndex
from kvstore.keys import ROOT_KEY, Root, block_keys
from kvstore.layered_blocks import encode_layered, load_units, memory_record, stored_records
from kvstore.layered_fetch import RecordFetcher
from kvstore.meta import LAYERED, BlockMeta
from kvstore.model import ModelSpec
from kvstore.stats import Counters
from kvstore.tiers.base import Tier
from kvstore.tiers.memory import MemoryTier
from kvstore.tiers.stack import TierStack
from kvstore.values import Array, LoadedChunk
from radix import MatchResult

if TYPE_CHECKING:  # kvstore.remote imports redis: only a store with a remote tier loads it
    from kvstore.remote import RemoteLink
    from kvstore.tiers.lmdb import LmdbTier

NewBlock = tuple[BlockMeta, list[bytes]]
MAX_RECORDS = 65535  # records per block: chunk indices are u16 in chunk keys (docs/keys.md)


class BlockMover:
    """Tier reads and writes, encode/decode, promotion; see module docstring. Thread-safe.

    Args:
        config: the store's configuration (block and chunk size, codec).
        index: decides eviction and lists what is held.
        memory: the memory tier.
        local_durable: durable tiers on this machine (LMDB), written before anything else.
        remote: the shared remote tier with its breaker and queue, if configured.
        counters: the store's counters.
    """

    def __init__(
        self, config: StoreConfig, index: StoreIndex, memory: MemoryTier, local_durable: Sequence[Tier],
        remote: RemoteLink | None, counters: Counters,
    ) -> None:  # fmt: skip
        self._config = config
        self._index = index
        self.tiers = TierStack(memory, tuple(local_durable), remote)
        self.memory = memory
        self.local_durable = list(local_durable)
        self.remote = remote
        self.durable: list[Tier] = list(self.tiers.durable)
        self._counters = counters
        self.layer_records = RecordFetcher(self.tiers, index, counters)  # the layered layout's reads

    # -- store path ---------------------------------------------------------------

    def encode_blocks(
        self, toks: Array, kv: Array, scores: Array | None, kv_start: int, first: int,
        model: ModelSpec, root: Root, namespace: str,
    ) -> list[NewBlock]:  # fmt: skip
        """Encode blocks `first`.. of `toks` (KV from token `kv_start`), each in importance order."""
        keys = block_keys(toks, self._config.block_tokens, model.fingerprint, root[0])
        return [
            self._encode_block(toks, kv, scores, kv_start, keys, index, model, root, namespace)
            for index in range(first, len(keys))
        ]

    def write_blocks(self, blocks: list[NewBlock], model: ModelSpec, root: Root) -> int:
        """Local durable tiers first (all blocks in one transaction), then memory, then the
        index, then the shared tier's queue. Returns the bytes written to the durable tiers."""
        if not blocks:
            return 0
        needed = sum(meta.nbytes for meta, _ in blocks)
        for tier in self.local_durable:
            self._put_durable(tier, blocks, needed)
            self._counters.add(f"bytes_written.{tier.name}", needed)
        raw = self._config.codec == "raw"  # memory holds raw chunks: no zstd on the hot path
        in_memory = [(m, c if raw else [memory_record(x, model.dtype) for x in c]) for m, c in blocks]
        if not self.local_durable:  # memory is the only local copy: make room for all, or fail now
            self._index.reserve_memory(sum(len(x) for _, c in in_memory for x in c))
        for meta, chunks in in_memory:
            if self._index.put_in_memory(meta, chunks):
                self._counters.add("bytes_written.memory", sum(len(x) for x in chunks))
            elif not self.local_durable:  # cannot happen after reserve_memory; never list what is not held
                raise StoreFullError("memory tier is full and there is no disk tier")
            self._index.insert(root, meta)
        if self.remote is not None:  # after the local commit; queued, never blocks
            for meta, chunks in blocks:
                self.remote.write(meta, chunks)
        return needed

    def put_meta(self, meta: BlockMeta) -> None:
        """Replace a block's metadata in every tier that holds it (new scores)."""
        for tier in [self.memory, *self.durable]:
            tier.put_meta(meta)

    # -- load path ----------------------------------------------------------------

    def read_blocks(self, plan: LoadPlan) -> Iterator[list[LoadedChunk] | None]:
        """Each planned block's chunks, verified whole before it is yielded. A block lost from
        every tier or corrupt yields None, is forgotten by the index, and ends the iteration."""
        prefetch = _Prefetch(self.local_durable, plan)
        for block_index, (meta, indices) in enumerate(zip(plan.blocks, plan.chunks, strict=True)):
            try:
                chunks = self._read_block(meta, block_index, indices, prefetch)
                failure = "chunk_misses" if chunks is None else ""
            except ChecksumError:
                chunks, failure = None, "checksum_failures"
            if chunks is None:  # this block and all after it become a miss
                self._counters.add(failure)
                self._index.forget(meta.key)
                yield None
                return
            yield chunks

    def _read_block(
        self, meta: BlockMeta, block_index: int, units: list[int], prefetch: _Prefetch
    ) -> list[LoadedChunk] | None:
        """The planned units of a block: its chunks, or a layered block's chunks of every layer."""
        if not meta.is_layered:
            return self.read_records(meta, block_index, units, prefetch)
        if not all(self.memory.has_chunk(meta.key, i) for i in stored_records(meta, units)):
            prefetch.start(block_index)
        return load_units(self.layer_records, meta, block_index, units)

    def read_records(
        self, meta: BlockMeta, block_index: int, indices: list[int], prefetch: _Prefetch | None = None
    ) -> list[LoadedChunk] | None:
        """Chunk records `indices` of a block, fastest tier first, verified and promoted to memory.

        Returns None if one is in no tier. Raises ChecksumError if a local one is corrupt.
        """
        found: dict[int, LoadedChunk] = {}
        tally: Counter[str] = Counter()
        for index, data in zip(indices, self.memory.get_chunks(meta, indices), strict=True):
            if data is not None:
                found[index] = self._decode(meta, block_index, index, data, self.memory.name, tally)
        self._index.touch_memory(meta, found)
        if len(found) < len(indices) and prefetch is not None:
            prefetch.start(block_index)
        for tier in self.durable:
            missing = [i for i in indices if i not in found]
            if not missing:
                break
            for index, data in zip(missing, tier.get_chunks(meta, missing), strict=True):
                if data is None:
                    continue
                chunk = self._decode_durable(meta, block_index, index, data, tier, tally)
                if chunk is not None:
                    found[index] = chunk
                    self._promote(meta, index, chunk, data)
        self._counters.add_many(tally)
        if len(found) < len(indices):
            return None
        return [found[i] for i in indices]

    def _decode(
        self, meta: BlockMeta, block_index: int, index: int, data: memoryview, tier: str, tally: Counter[str]
    ) -> LoadedChunk:
        # Memory holds chunks this process encoded in immutable buffers: skip the checksum.
        decoded = decode_chunk(data, meta.chunk_id(index), trusted=tier == self.memory.name)
        tally[f"chunk_hits.{tier}"] += 1
        tally[f"bytes_read.{tier}"] += len(data)
        return LoadedChunk(block_index, index, decoded.positions, decoded.kv, tier, len(data))

    def _decode_durable(
        self, meta: BlockMeta, block_index: int, index: int, data: memoryview, tier: Tier, tally: Counter[str]
    ) -> LoadedChunk | None:
        """Decode a chunk read from disk or the remote tier. A remote chunk that fails its
        checksum or identity is a miss, counted, and deleted remotely (its key is a content
        hash: the value is wrong for every reader). A local one raises ChecksumError."""
        if self.remote is None or tier is not self.remote.tier:
            return self._decode(meta, block_index, index, data, tier.name, tally)
        try:
            return self._decode(meta, block_index, index, data, tier.name, tally)
        except ChecksumError:
            self.remote.tier.count_corrupt()
            with contextlib.suppress(KVSieveError):  # counted by the tier; a later reader retries
                self.remote.tier.delete_block(meta.key)
            return None

    def _promote(self, meta: BlockMeta, index: int, chunk: LoadedChunk, data: memoryview) -> None:
        if self._config.codec != "raw":  # memory holds raw chunks: no zstd on the hot path
            raw = encode_chunk(meta.chunk_id(index), chunk.positions, chunk.kv, chunk.kv.dtype.name, "raw")
            data = memoryview(raw)
        self._index.promote(meta, index, data)

    def local_metas(self) -> list[BlockMeta]:
        """Every block record of the local disk tier, for the start-up rebuild. Records that
        fail their checksum or identity check are skipped and counted (`metadata_failures`)."""
        if not self.local_durable:
            return []
        records = [m for _, m in cast("LmdbTier", self.local_durable[0]).iter_meta_raw()]
        self._counters.add("metadata_failures", sum(not isinstance(m, BlockMeta) for m in records))
        return [m for m in records if isinstance(m, BlockMeta)]

    # -- the shared remote tier ---------------------------------------------------

    def learn_remote(self, root: Root, toks: Array, match: MatchResult) -> int:
        """List the blocks after `match` that other sidecars put in the remote tier. Returns
        how many were learned (0 without a remote tier, or when `toks` has no further block)."""
        b = self._config.block_tokens
        if self.remote is None or len(toks) < match.num_tokens + b:
            return 0
        wanted = block_keys(toks, b, root[1], root[0])[len(match.nodes) :]
        learned = 0
        for key, meta in zip(wanted, self.remote.tier.get_metas(wanted), strict=True):
            if meta is None or meta.key != key or meta.num_tokens != b:
                break
            self._index.insert(root, meta)
            learned += 1
        if learned:
            self._counters.add("blocks_learned.redis", learned)
        return learned

    # -- internals ----------------------------------------------------------------

    def _encode_block(
        self, toks: Array, kv: Array, scores: Array | None, kv_start: int, keys: list[bytes],
        index: int, model: ModelSpec, root: Root, namespace: str,
    ) -> NewBlock:  # fmt: skip
        b, c = self._config.block_tokens, self._config.chunk_tokens
        start = index * b
        local = start - kv_start  # where the block starts in `kv` and `scores`
        block_scores = None if scores is None else scores[local : local + b]
        if self._config.layout == LAYERED:
            return self._encode_layered(
                toks, kv[:, :, :, local : local + b], block_scores, keys, index, model, root, namespace
            )
        perm = importance_order(block_scores, b)
        ns = root[0]  # the namespace digest
        chunks = []
        for chunk_index in range(b // c):
            offsets = perm[chunk_index * c : (chunk_index + 1) * c]
            cid = ChunkId(model.fingerprint, ns, keys[index], 0, chunk_index)
            data = kv[:, :, :, local + offsets, :]
            chunks.append(
                encode_chunk(
                    cid, start + offsets, data, model.dtype, self._config.codec, self._config.zstd_level
                )
            )
        parent = keys[index - 1] if index else ROOT_KEY
        meta = BlockMeta(
            keys[index], parent, model.fingerprint, ns, index, toks[start : start + b].copy(),
            c, 0, perm, block_scores, sum(len(x) for x in chunks), time.time(), namespace,
        )  # fmt: skip
        return meta, chunks

    def _encode_layered(
        self, toks: Array, block_kv: Array, block_scores: Array | None, keys: list[bytes], index: int,
        model: ModelSpec, root: Root, namespace: str,
    ) -> NewBlock:  # fmt: skip
        """A block in the layered layout (kvstore/layered_blocks.py): prompt order, scores kept."""
        b, c = self._config.block_tokens, self._config.layer_chunk_tokens
        if model.num_layers * (1 + b // c) > MAX_RECORDS:  # record indices are u16 in chunk keys
            raise InvalidInputError(
                f"layer_chunk_tokens {c} gives {model.num_layers * (1 + b // c)} records per block of "
                f"{model.name}, more than {MAX_RECORDS}: use larger chunks"
            )
        parent = keys[index - 1] if index else ROOT_KEY
        meta = BlockMeta(
            keys[index], parent, model.fingerprint, root[0], index, toks[index * b : (index + 1) * b].copy(),
            c, 0, np.arange(b, dtype=np.int64), block_scores, 0, time.time(), namespace, LAYERED,
            model.num_layers,
        )  # fmt: skip
        cfg = self._config
        records = encode_layered(meta, block_kv, model.dtype, cfg.codec, cfg.zstd_level)
        return replace(meta, nbytes=sum(len(x) for x in records)), records

    def _put_durable(self, tier: Tier, blocks: list[NewBlock], needed: int) -> None:
        usage = tier.usage()
        if usage.capacity_bytes is not None and usage.used_bytes + needed > usage.capacity_bytes:
            self._index.evict(usage.used_bytes + needed - usage.capacity_bytes)
            usage = tier.usage()
            if usage.used_bytes + needed > (usage.capacity_bytes or 0):
                raise StoreFullError(
                    f"{tier.name} tier budget of {usage.capacity_bytes} B is held by pinned blocks "
                    f"({usage.used_bytes} B used, {needed} B needed); nothing of this call was kept"
                )
        try:
            tier.put_blocks(blocks)
        except TierFullError:
            self._index.evict(max(needed, (usage.capacity_bytes or 0) // 10))
            try:
                tier.put_blocks(blocks)
            except TierFullError as exc:
                raise StoreFullError(f"{tier.name} tier is full: {exc}") from exc


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
