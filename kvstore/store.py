"""TieredStore: lookup / store / load of prefix KV over memory, disk and remote tiers.

Bookkeeping (the radix tree, leases, selection) is kept apart from moving bytes
(the tiers). The tree learns a block only after its data is durable in the slowest
local tier, so a lookup never promises data that a crash could lose. The new
blocks of one `store` call go to disk in one transaction: all of them or none.

The tree owns eviction of what it lists: disk-budget pressure evicts through it,
and in a memory-only store the memory tier never evicts by itself (the tree picks
the victims), so lookup never reports a block that load cannot deliver. With a
durable tier, memory is a cache of it and evicts chunks by its own policy.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from importance.history import accumulate, decay_factor
from importance.layout import budget_to_tokens, importance_order, select_chunks
from kvstore.codec import ChunkId, decode_chunk, encode_chunk
from kvstore.config import StoreConfig
from kvstore.errors import ChecksumError, InvalidInputError, KVSieveError, StoreFullError
from kvstore.keys import ROOT_KEY, as_token_array, block_keys, namespace_digest
from kvstore.leases import Lease, LeaseTable
from kvstore.lock import DataDirLock
from kvstore.meta import BlockMeta
from kvstore.model import ModelSpec
from kvstore.results import (
    DEFAULT_NAMESPACE,
    Array,
    LoadedChunk,
    LoadStream,
    LookupResult,
    StoreResult,
    gather_chunks,
    validate_kv,
)
from kvstore.stats import Counters, StoreStats
from kvstore.tiers import Tier, TierFullError, create_tier
from kvstore.tiers.memory import MemoryTier, create_policy
from radix import MatchResult, RadixTree

if TYPE_CHECKING:
    from kvstore.remote import RemoteLink
    from kvstore.tiers.lmdb import LmdbTier
    from kvstore.tiers.redis import RedisTier

NewBlock = tuple[BlockMeta, list[bytes]]

__all__ = [
    "DEFAULT_NAMESPACE",
    "LoadStream",
    "LoadedChunk",
    "LookupResult",
    "StoreResult",
    "TieredStore",
    "gather_chunks",
    "validate_kv",
]


class TieredStore:
    """Prefix KV over tiers; see module docstring. Thread-safe."""

    def __init__(
        self, config: StoreConfig | None = None, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config or StoreConfig()
        self.tree = RadixTree(self.config.block_tokens)
        self.memory = MemoryTier(
            self.config.memory_bytes,
            policy=create_policy(self.config.memory_policy),
            is_pinned=self.tree.is_pinned,
            pin_host_memory=self.config.pin_host_memory,
            # Only a cache of a durable tier may drop chunks the tree still lists.
            self_evict=self.config.lmdb_dir is not None or self.config.has_remote,
        )
        self.durable: list[Tier] = []
        self._lock = None
        if self.config.data_dir is not None:
            self._lock = DataDirLock(
                self.config.data_dir, exclusive=False, purpose="opening a store"
            ).acquire()
        if self.config.lmdb_dir is not None:
            self.durable.append(
                create_tier("lmdb", path=self.config.lmdb_dir, capacity_bytes=self.config.disk_bytes)
            )
        # The durable tiers on this machine: local pressure frees these, never the shared tier.
        self.local_durable: list[Tier] = list(self.durable)
        self.counters = Counters()
        self.remote_link = self._open_remote()
        if self.remote_link is not None:
            self.durable.append(self.remote_link.tier)
        self.leases = LeaseTable(self.tree.pin, self.tree.unpin, clock)  # clock: lease expiry only
        self._write_lock = threading.Lock()
        self._closed = False
        self.orphans = self._rebuild_tree()

    # -- public API ---------------------------------------------------------------

    @property
    def local_only(self) -> bool:
        """True when lookups never leave the process (no remote tier to probe)."""
        return self._remote() is None

    def lookup(
        self, tokens: Sequence[int] | Array, *, model: ModelSpec, namespace: str = DEFAULT_NAMESPACE
    ) -> LookupResult:
        """Longest cached block-aligned prefix of `tokens`. Reads no data."""
        toks = as_token_array(tokens)
        match = self._match(self._root(model, namespace), toks)
        self.counters.add_many({"lookups": 1, "lookup_hits": int(match.num_tokens > 0)})
        in_memory = sum(1 for n in match.nodes if self.memory.contains(n.key))
        return LookupResult(match.num_tokens, len(match.nodes), in_memory)

    def store(
        self,
        tokens: Sequence[int] | Array,
        kv: Array,
        *,
        model: ModelSpec,
        namespace: str = DEFAULT_NAMESPACE,
        scores: Array | None = None,
        kv_start: int = 0,
    ) -> StoreResult:
        """Store the new full blocks of a prefix; blocks already cached are skipped.

        Args:
            tokens: token ids of the prefix.
            kv: KV of tokens[kv_start:], shape `model.kv_shape(len(tokens) - kv_start)`,
                dtype `model.dtype`.
            scores: optional per-token importance of the same tokens as `kv`; each new
                block is written in descending score order (online layout).
            kv_start: first token `kv` covers, a multiple of block_tokens. An engine that
                loaded the prefix's first blocks sends only the KV it computed; if one
                of those first blocks is no longer cached, nothing can be stored.

        All new blocks are written or none (one LMDB transaction); on an error
        nothing of this call is kept.

        Raises:
            InvalidInputError: bad tokens, shape, dtype or scores; nothing is written.
            StoreFullError: the budget is held by pinned blocks, or the disk is full.
            StorageUnavailableError: an I/O error, or the data file was deleted under us.
        """
        toks = as_token_array(tokens)
        b = self.config.block_tokens
        if not isinstance(kv_start, int) or kv_start < 0 or kv_start % b or kv_start > len(toks):
            raise InvalidInputError(
                f"kv_start must be a multiple of block_tokens ({b}) in [0, {len(toks)}], got {kv_start!r}"
            )
        kv, scores = validate_kv(toks[kv_start:], kv, scores, model)
        root = self._root(model, namespace)
        keys = block_keys(toks, b, model.fingerprint, root[0])
        with self._write_lock:
            match = self.tree.match(root, toks, touch=False)
            if len(match.nodes) < kv_start // b:  # a block before the KV we have is gone
                return StoreResult(match.num_tokens, 0, 0)
            held = [n.key for n in match.nodes]
            self.tree.pin(held)  # the parent chain must survive eviction for this store
            try:
                blocks = [
                    self._encode_block(toks, kv, scores, kv_start, keys, index, model, root, namespace)
                    for index in range(len(match.nodes), len(keys))
                ]
                written = self._write_blocks(blocks, model, root, toks)
            finally:
                self.tree.unpin(held)
        new_blocks = len(keys) - len(match.nodes)
        self.counters.add("stores")
        self.counters.add("blocks_written", new_blocks)
        return StoreResult(len(keys) * self.config.block_tokens, new_blocks, written)

    def load(
        self,
        tokens: Sequence[int] | Array,
        *,
        model: ModelSpec,
        namespace: str = DEFAULT_NAMESPACE,
        budget: float = 1.0,
        budget_tokens: int | None = None,
    ) -> LoadStream:
        """Stream the cached prefix of `tokens`, or its most important share.

        Args:
            budget: fraction of the matched prefix's tokens to select, in (0, 1].
            budget_tokens: a token count instead of a fraction (overrides `budget`).

        Each block's chunks are read and verified before any of them is yielded, so
        a consumer never sees part of a corrupt block; a corrupt block ends the
        stream there (`LoadStream.num_tokens` says how far it got).
        """
        toks = as_token_array(tokens)
        _check_budget(budget, budget_tokens)
        match = self._match(self._root(model, namespace), toks)
        metas: list[BlockMeta] = [n.payload for n in match.nodes]
        wanted = budget_tokens if budget_tokens is not None else budget_to_tokens(budget, match.num_tokens)
        selection = select_chunks([_slot_scores(m) for m in metas], wanted, self.config.chunk_tokens)
        stream = LoadStream(match.num_tokens, sum(s.selected_tokens for s in selection), model.token_bytes)
        stream._source = self._stream_blocks(stream, metas, [s.chunks for s in selection])
        self.counters.add("loads")
        return stream

    def load_arrays(self, tokens: Sequence[int] | Array, **kwargs: Any) -> tuple[int, Array, Array]:
        """`load`, gathered: (prefix tokens covered, positions (n,), kv (L, 2, H, n, D))."""
        stream = self.load(tokens, **kwargs)
        positions, kv = stream.gather(kwargs["model"])
        return stream.num_tokens, positions, kv

    def pin(
        self,
        tokens: Sequence[int] | Array,
        *,
        model: ModelSpec,
        namespace: str = DEFAULT_NAMESPACE,
        ttl_s: float = 60.0,
    ) -> Lease:
        """Pin the cached prefix of `tokens` for `ttl_s` seconds (a lease). Mutates."""
        match = self.tree.match(self._root(model, namespace), as_token_array(tokens), touch=False)
        return self.leases.grant([n.key for n in match.nodes], ttl_s)

    def unpin(self, lease_id: str) -> None:
        """Release a lease. Mutates. NotFoundError if it is unknown or expired."""
        self.leases.release(lease_id)

    def report_scores(
        self,
        tokens: Sequence[int] | Array,
        scores: Array,
        *,
        model: ModelSpec,
        namespace: str = DEFAULT_NAMESPACE,
    ) -> int:
        """Fold per-token importance (one float per token) into the cached blocks' scores.

        Each block's scores become decay * old + reported (see importance.history);
        the layout is untouched until re-layout. Mutates metadata in every tier.
        Returns the number of blocks updated.
        """
        toks = as_token_array(tokens)
        values = np.asarray(scores, dtype=np.float32)
        if values.shape != (len(toks),) or not np.all(np.isfinite(values)):
            raise InvalidInputError(f"scores must be {len(toks)} finite floats, got shape {values.shape}")
        match = self.tree.match(self._root(model, namespace), toks, touch=False)
        decay = decay_factor(self.config.score_half_life_reports)
        b = self.config.block_tokens
        for i, node in enumerate(match.nodes):
            meta: BlockMeta = node.payload
            updated = replace(meta, scores=accumulate(meta.scores, values[i * b : (i + 1) * b], decay))
            for tier in [self.memory, *self.durable]:
                tier.put_meta(updated)
            node.payload = updated
        self.counters.add("score_reports")
        return len(match.nodes)

    def stats(self) -> StoreStats:
        """Counters and occupancy of every tier."""
        self.leases.sweep()
        counters, samples = self.counters.snapshot()
        counters["leases_expired"] = self.leases.expired_total
        counters["evictions.memory"] = self.memory.evictions
        if self.remote_link is not None:
            counters |= self.remote_link.counters()
        tiers = {t.name: t.usage() for t in [self.memory, *self.durable]}
        return StoreStats(counters, tiers, self.tree.num_blocks, len(self.leases), samples)

    def close(self) -> None:
        """Close every tier. Idempotent."""
        if not self._closed:
            self._closed = True
            if self.remote_link is not None:
                self.remote_link.close()  # drains queued remote writes first
            for tier in [self.memory, *self.durable]:
                tier.close()
            if self._lock is not None:
                self._lock.release()

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- store path ---------------------------------------------------------------

    def _encode_block(
        self, toks: Array, kv: Array, scores: Array | None, kv_start: int, keys: list[bytes],
        index: int, model: ModelSpec, root: tuple[bytes, bytes], namespace: str,
    ) -> tuple[BlockMeta, list[bytes]]:  # fmt: skip
        b, c = self.config.block_tokens, self.config.chunk_tokens
        start = index * b
        local = start - kv_start  # where the block starts in `kv` and `scores`
        block_scores = None if scores is None else scores[local : local + b]
        perm = importance_order(block_scores, b)
        chunks = []
        for chunk_index in range(b // c):
            offsets = perm[chunk_index * c : (chunk_index + 1) * c]
            cid = ChunkId(model.fingerprint, root[0], keys[index], 0, chunk_index)
            data = kv[:, :, :, local + offsets, :]
            chunks.append(
                encode_chunk(
                    cid,
                    start + offsets,
                    data,
                    model.dtype,
                    self.config.codec,
                    self.config.zstd_level,
                )
            )
        parent = keys[index - 1] if index else ROOT_KEY
        meta = BlockMeta(
            keys[index], parent, model.fingerprint, root[0], index, toks[start : start + b].copy(),
            c, 0, perm, block_scores, sum(len(x) for x in chunks), time.time(), namespace,
        )  # fmt: skip
        return meta, chunks

    def _write_blocks(
        self, blocks: list[NewBlock], model: ModelSpec, root: tuple[bytes, bytes], toks: Array
    ) -> int:
        """Local durable tiers first (all blocks at once), then memory, then the tree, then the
        shared tier's queue. Returns bytes."""
        if not blocks:
            return 0
        needed = sum(meta.nbytes for meta, _ in blocks)
        local = self.local_durable
        for tier in local:
            self._put_durable(tier, blocks, needed)
            self.counters.add(f"bytes_written.{tier.name}", needed)
        raw = self.config.codec == "raw"
        in_memory = [(m, c if raw else [_reencode_raw(x, model) for x in c]) for m, c in blocks]
        if not local:  # memory is the only local copy: make room for all of them, or fail now
            self._reserve_memory(sum(len(x) for _, c in in_memory for x in c))
        b = self.config.block_tokens
        for meta, chunks in in_memory:
            try:
                self.memory.put_block(meta, chunks)
                self.counters.add("bytes_written.memory", sum(len(x) for x in chunks))
            except TierFullError:
                if not local:  # cannot happen after _reserve_memory; never list what is not held
                    raise StoreFullError("memory tier is full and there is no disk tier") from None
            parent = None if meta.depth == 0 else meta.parent
            self.tree.insert(root, parent, toks[meta.start : meta.start + b], meta.key, meta.nbytes, meta)
        if self.remote_link is not None:  # after the local commit; queued, never blocks
            for meta, chunks in blocks:
                self.remote_link.write(meta, chunks)
        return needed

    def _put_durable(self, tier: Tier, blocks: list[NewBlock], needed: int) -> None:
        usage = tier.usage()
        if usage.capacity_bytes is not None and usage.used_bytes + needed > usage.capacity_bytes:
            self._evict(usage.used_bytes + needed - usage.capacity_bytes)
            usage = tier.usage()
            if usage.used_bytes + needed > (usage.capacity_bytes or 0):
                raise StoreFullError(
                    f"{tier.name} tier budget of {usage.capacity_bytes} B is held by pinned blocks "
                    f"({usage.used_bytes} B used, {needed} B needed); nothing of this call was kept"
                )
        try:
            _put_all(tier, blocks)
        except TierFullError:
            self._evict(max(needed, (usage.capacity_bytes or 0) // 10))
            try:
                _put_all(tier, blocks)
            except TierFullError as exc:
                raise StoreFullError(f"{tier.name} tier is full: {exc}") from exc

    def _reserve_memory(self, size: int) -> None:
        """Memory-only store: evict least recently used blocks through the tree until `size` fits."""
        while True:
            usage = self.memory.usage()
            capacity = usage.capacity_bytes or 0
            if size > capacity:
                raise StoreFullError(f"{size} B of new blocks exceed the memory tier's {capacity} B")
            if usage.used_bytes + size <= capacity:
                return
            victims = self.tree.evict(usage.used_bytes + size - capacity)
            if not victims:
                raise StoreFullError(
                    "memory tier is full of pinned blocks and there is no disk tier; nothing was kept"
                )
            for node in victims:
                self.memory.evict_block(node.key)

    def _evict(self, num_bytes: int) -> None:
        # Local pressure frees local tiers only: the shared tier holds blocks other
        # sidecars use, and bounds itself (maxmemory eviction).
        for node in self.tree.evict(num_bytes):
            for tier in [self.memory, *self.local_durable]:
                tier.delete_block(node.key)
            self.counters.add("evictions.disk")

    # -- load path ----------------------------------------------------------------

    def _stream_blocks(
        self, stream: LoadStream, metas: list[BlockMeta], wanted: list[list[int]]
    ) -> Iterator[LoadedChunk]:
        for block_index, (meta, chunk_indices) in enumerate(zip(metas, wanted, strict=True)):
            try:
                chunks = self._read_block(meta, block_index, chunk_indices)
                failure = "chunk_misses" if chunks is None else ""  # None: evicted from every tier
            except ChecksumError:
                chunks, failure = None, "checksum_failures"
            if chunks is None:  # this block and all after it become a miss
                self.counters.add(failure)
                self._forget(meta.key)
                stream.num_tokens = block_index * self.config.block_tokens
                break
            for chunk in chunks:
                stream.bytes_read += chunk.nbytes
                stream.delivered_tokens += len(chunk.positions)
                yield chunk
        self.counters.add("bytes_selected", stream.selected_tokens * stream._token_bytes)
        self.counters.sample_read_amplification(stream.read_amplification)

    def _read_block(self, meta: BlockMeta, block_index: int, indices: list[int]) -> list[LoadedChunk] | None:
        found: dict[int, LoadedChunk] = {}
        tally: Counter[str] = Counter()
        for index, data in zip(indices, self.memory.get_chunks(meta, indices), strict=True):
            if data is not None:
                found[index] = self._decode(meta, block_index, index, data, self.memory.name, tally)
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
        self.counters.add_many(tally)
        if len(found) < len(indices):
            return None
        return [found[i] for i in indices]

    def _decode(
        self,
        meta: BlockMeta,
        block_index: int,
        index: int,
        data: memoryview,
        tier: str,
        tally: Counter[str],
    ) -> LoadedChunk:
        expect = ChunkId(meta.fingerprint, meta.namespace, meta.key, meta.layout_version, index)
        # Memory holds chunks this process encoded in immutable buffers: skip the checksum.
        decoded = decode_chunk(data, expect, trusted=tier == self.memory.name)
        tally[f"chunk_hits.{tier}"] += 1
        tally[f"bytes_read.{tier}"] += len(data)
        return LoadedChunk(block_index, index, decoded.positions, decoded.kv, tier, len(data))

    def _decode_durable(
        self, meta: BlockMeta, block_index: int, index: int, data: memoryview, tier: Tier, tally: Counter[str]
    ) -> LoadedChunk | None:
        """Decode a chunk read from disk or the remote tier. A remote chunk that fails its
        checksum or identity is a miss, counted, and deleted remotely (its key is a content
        hash: the value is wrong for every reader). A local one raises ChecksumError."""
        remote = self._remote()
        if remote is None or tier is not remote:
            return self._decode(meta, block_index, index, data, tier.name, tally)
        try:
            return self._decode(meta, block_index, index, data, tier.name, tally)
        except ChecksumError:
            remote.count_corrupt()
            with contextlib.suppress(KVSieveError):  # counted by the tier; a later reader retries
                remote.delete_block(meta.key)
            return None

    def _promote(self, meta: BlockMeta, index: int, chunk: LoadedChunk, data: memoryview) -> None:
        if self.config.codec != "raw":  # memory holds raw chunks: no zstd on the hot path
            cid = ChunkId(meta.fingerprint, meta.namespace, meta.key, meta.layout_version, index)
            data = memoryview(encode_chunk(cid, chunk.positions, chunk.kv, chunk.kv.dtype.name, "raw"))
        self.memory.put_chunk(meta, index, data)

    def _forget(self, key: bytes) -> None:
        for node in self.tree.remove(key):
            self.memory.delete_block(node.key)

    # -- start-up -----------------------------------------------------------------

    def _match(self, root: tuple[bytes, bytes], toks: Array) -> MatchResult:
        """Match locally; where the local tree ends, learn blocks other sidecars put remotely."""
        match = self.tree.match(root, toks)
        remote = self._remote()
        if remote is None or len(toks) < match.num_tokens + self.config.block_tokens:
            return match
        keys = block_keys(toks, self.config.block_tokens, root[1], root[0])
        learned = 0
        wanted = keys[len(match.nodes) :]
        for key, meta in zip(wanted, remote.get_metas(wanted), strict=True):
            if meta is None or meta.key != key or meta.num_tokens != self.config.block_tokens:
                break
            parent = None if meta.depth == 0 else meta.parent
            self.tree.insert(root, parent, meta.tokens, meta.key, meta.nbytes, meta)
            learned += 1
        if not learned:
            return match
        self.counters.add("blocks_learned.redis", learned)
        return self.tree.match(root, toks)

    def _remote(self) -> RedisTier | None:
        return None if self.remote_link is None else self.remote_link.tier

    def _open_remote(self) -> RemoteLink | None:
        if not self.config.has_remote:
            return None
        from kvstore.remote import RemoteLink  # imports redis only when a remote tier is used

        def written(nbytes: int) -> None:
            self.counters.add_many({"bytes_written.redis": nbytes, "remote.writes": 1})

        return RemoteLink(self.config, on_written=written)

    def _root(self, model: ModelSpec, namespace: str) -> tuple[bytes, bytes]:
        return (namespace_digest(namespace), model.fingerprint)

    def _rebuild_tree(self) -> int:
        """Learn every block on the local disk tier (a restarted store is warm). Returns orphans.

        Records that fail their checksum or identity check are skipped and counted
        (`metadata_failures`): their prompts are misses until stored again.
        """
        if not self.durable or self.config.lmdb_dir is None:
            return 0
        records = list(cast("LmdbTier", self.durable[0]).iter_meta_raw())
        metas = sorted(
            (m for _, m in records if isinstance(m, BlockMeta)), key=lambda m: (m.depth, m.created)
        )
        self.counters.add("metadata_failures", len(records) - len(metas))
        orphans = 0
        for meta in metas:
            parent = None if meta.depth == 0 else meta.parent
            parent_node = None if parent is None else self.tree.get(parent)
            if (
                parent is not None and (parent_node is None or parent_node.depth != meta.depth - 1)
            ) or meta.num_tokens != self.config.block_tokens:
                orphans += 1
                continue
            self.tree.insert(
                (meta.namespace, meta.fingerprint), parent, meta.tokens, meta.key, meta.nbytes, meta
            )
        return orphans


def _put_all(tier: Tier, blocks: list[NewBlock]) -> None:
    """One transaction where the tier offers it (LMDB `put_blocks`), else block by block."""
    put_blocks = getattr(tier, "put_blocks", None)
    if put_blocks is not None:
        put_blocks(blocks)
        return
    for meta, chunks in blocks:
        tier.put_block(meta, chunks)


def _check_budget(budget: float, budget_tokens: int | None) -> None:
    if budget_tokens is not None:
        if not isinstance(budget_tokens, int | np.integer) or budget_tokens < 1:
            raise InvalidInputError(f"budget_tokens must be an integer >= 1, got {budget_tokens!r}")
        return
    if not isinstance(budget, int | float) or not 0.0 < float(budget) <= 1.0:
        raise InvalidInputError(f"budget must be a fraction in (0, 1], got {budget!r}")


def _slot_scores(meta: BlockMeta) -> Array:
    if meta.scores is None:
        return np.zeros(meta.num_tokens, dtype=np.float32)
    return meta.scores[meta.permutation]


def _reencode_raw(data: bytes, model: ModelSpec) -> bytes:
    decoded = decode_chunk(data)
    return encode_chunk(decoded.chunk_id, decoded.positions, decoded.kv, model.dtype, "raw")
