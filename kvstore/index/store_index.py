"""StoreIndex: what the store holds, apart from the bytes (the reader and writer move those).

The radix tree lists every block whose data is durable in the slowest local tier
(or, in a memory-only store, held whole in memory), so a lookup never promises
what a load cannot deliver. Beside it: the leases that pin blocks and eviction
of every local tier, which has this one owner (which chunks a load reads is planned
apart, from the matched blocks' metadata: kvstore/load/plan.py):

- disk pressure evicts least recently used unpinned blocks through the tree, from
  every local tier at once (never from the shared remote tier: other sidecars use it);
- in a memory-only store, memory pressure does the same (whole blocks);
- beside a durable tier, memory is a cache of it and gives up single chunks ranked
  by the configured policy (kvstore/index/eviction.py), never chunks of pinned blocks;
- a block dropped as lost or damaged (`forget`) leaves every local tier at once, the
  blocks below it too: once unlisted nothing reaches their records, which would otherwise
  hold the disk budget (as unevictable bytes) until a restart or `fsck --repair`.

The tiers only store bytes and count them. Every method is thread-safe.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager

import numpy as np

from kvstore.api import Lease
from kvstore.config import StoreConfig
from kvstore.errors import KVSieveError, StoreFullError, TierFullError
from kvstore.format.block_meta import BlockMeta
from kvstore.format.layered_block import stored_records
from kvstore.index.eviction import create_policy
from kvstore.index.leases import LeaseTable
from kvstore.index.listener import BlockListener
from kvstore.stats import Counters
from kvstore.tiers.base import Tier
from kvstore.tiers.memory import MemoryTier
from radix import MatchResult, Node, RadixTree, RootId
from radix.tree import Pin


class StoreIndex:
    """Radix tree, leases and eviction of the local tiers; see module docstring.

    Args:
        config: the store's configuration (block and chunk size, memory policy).
        memory: the memory tier (plain storage; this index evicts from it).
        local_durable: the durable tiers on this machine (LMDB), evicted with the tree.
        memory_is_cache: memory is a cache of a durable tier (local or remote), so it
            may give up single chunks; otherwise it holds the only copy of what the
            tree lists and gives up whole blocks only.
        counters: where evictions are counted.
        clock: lease expiry clock (monotonic seconds).
    """

    def __init__(
        self, config: StoreConfig, memory: MemoryTier, local_durable: Sequence[Tier], *,
        memory_is_cache: bool, counters: Counters, clock: Callable[[], float] = time.monotonic,
    ) -> None:  # fmt: skip
        self._config = config
        self.tree = RadixTree(config.block_tokens)
        self.leases = LeaseTable(self.tree.pin, self.tree.unpin, clock)
        self._memory = memory
        self._local = list(local_durable)
        self._memory_is_cache = memory_is_cache
        self._policy = create_policy(config.memory_policy)
        self._memory_lock = threading.Lock()  # policy + make-room + put are one step
        self._reclaim_lock = threading.Lock()
        self._unreclaimed: set[bytes] = set()  # forgotten blocks still to delete from local tiers
        self._counters = counters
        self.memory_evictions = 0  # chunks evicted from memory since start
        # Told of every listed and unlisted block (KV events); changes and their news are made
        # under one lock so that the news arrives in the order of the changes.
        self._listener: BlockListener | None = None
        self._listen_lock = threading.Lock()
        self._whole_in_memory: set[bytes] = set()  # blocks held whole by memory as a cache

    # -- what is cached -----------------------------------------------------------

    def match(self, root: RootId, tokens: np.ndarray, touch: bool = True) -> MatchResult:
        """Longest cached prefix of `tokens` under `root`; refreshes recency when `touch`."""
        return self.tree.match(root, tokens, touch=touch)

    def insert(self, root: RootId, meta: BlockMeta) -> None:
        """List a block whose data is held (its parent must be listed). Mutates."""
        parent = None if meta.depth == 0 else meta.parent
        with self._listen_lock:
            self.tree.insert(root, parent, meta.tokens, meta.key, meta.nbytes, meta)
            if self._listener is not None:
                self._listener.blocks_listed((meta,))

    def watch(self, listener: BlockListener | None) -> None:
        """Tell `listener` of every block listed or unlisted from now on (None: nobody). Mutates."""
        with self._listen_lock:
            self._listener = listener

    def keys_in_memory(self) -> set[bytes]:
        """The blocks a full load would read from memory alone, where memory caches a durable tier
        (a copy; a layered block needs its layer pack, not its key summaries)."""
        with self._memory_lock:
            return set(self._whole_in_memory)

    def _memory_changed_locked(self, key: bytes, meta: BlockMeta | None = None) -> None:
        """Tell the listener when a block becomes held whole in memory, or stops being (memory
        as a cache only: a memory-only store's blocks are all in memory while listed)."""
        if not self._memory_is_cache:
            return
        # whole: every record a full load reads (a layered block's key summaries are not among them)
        whole = meta is not None and self._memory.holds(key, stored_records(meta, range(meta.num_chunks)))
        if whole == (key in self._whole_in_memory):
            return
        listener = self._listener
        if whole:
            assert meta is not None
            self._whole_in_memory.add(key)
            if listener is not None:
                listener.blocks_in_memory((meta,))
        else:
            self._whole_in_memory.discard(key)
            if listener is not None:
                listener.blocks_out_of_memory((key,))

    def _unlist(self, remove: Callable[[], list[Node]]) -> list[Node]:
        """Run a tree removal and tell the listener what left, in one step."""
        with self._listen_lock:
            removed = remove()
            if removed and self._listener is not None:
                self._listener.blocks_unlisted([node.payload for node in removed])
        return removed

    def update(self, node: Node, meta: BlockMeta) -> None:
        """Replace a listed block's metadata (new scores). Mutates."""
        node.payload = meta

    def forget(self, key: bytes) -> int:
        """Unlist a block and every block below it (lost, corrupt, or of other geometry) and drop
        them from memory and from every local durable tier, so their bytes leave the disk budget
        at once (never from the shared remote tier: other sidecars use it). Mutates.

        A local delete that fails (the tier's storage failed) is retried before the next eviction.
        Returns the bytes freed on the local durable tiers.
        """
        with self._memory_lock:
            removed = self._unlist(lambda: self.tree.remove(key))
            for node in removed:
                self._drop_from_memory_locked(node.payload)
        if removed:
            self._counters.add("blocks_dropped", len(removed))
        with self._reclaim_lock:
            self._unreclaimed.update(node.key for node in removed)
        return self._reclaim()

    def drop_unlisted(self, keys: Iterable[bytes]) -> int:
        """Delete blocks from the local durable tiers unless they are listed (a pending block
        forgotten while its group commit wrote it). Returns the bytes freed."""
        with self._reclaim_lock:
            self._unreclaimed.update(keys)
        return self._reclaim()

    def _reclaim(self) -> int:
        """Delete forgotten blocks from the local durable tiers (outside the memory lock, as
        `evict` does). Keys whose delete fails stay for the next try. Returns the bytes freed."""
        with self._reclaim_lock:
            keys, self._unreclaimed = self._unreclaimed, set()
        freed, failed = 0, set()
        for block in keys:
            if self.tree.get(block) is not None:  # stored again meanwhile: it is listed, keep it
                continue
            for tier in self._local:
                try:
                    freed += tier.delete_block(block)
                except KVSieveError:
                    failed.add(block)
        if failed:
            with self._reclaim_lock:
                self._unreclaimed |= failed
        return freed

    def rebuild(self, metas: Iterable[BlockMeta]) -> int:
        """List the blocks of a durable tier at start-up, parents first. Returns orphans skipped."""
        orphans = 0
        for meta in sorted(metas, key=lambda m: (m.depth, m.created)):
            parent = None if meta.depth == 0 else self.tree.get(meta.parent)
            if (meta.depth and (parent is None or parent.depth != meta.depth - 1)) or (
                meta.num_tokens != self._config.block_tokens
            ):
                orphans += 1
                continue
            self.insert((meta.namespace, meta.fingerprint), meta)
        return orphans

    @contextmanager
    def held(self, nodes: Sequence[Node]) -> Iterator[None]:
        """Pin `nodes` for the duration (a store's parent chain must survive eviction)."""
        pin = self.tree.pin(nodes)
        try:
            yield
        finally:
            self.tree.unpin(pin)

    def block_bytes(self, key: bytes) -> int:
        """Encoded bytes of a listed block (0 if it is not listed)."""
        node = self.tree.get(key)
        return 0 if node is None else node.nbytes

    # -- leases -------------------------------------------------------------------

    def grant(self, match: MatchResult, ttl_s: float) -> Lease:
        """Pin the matched blocks for `ttl_s` seconds. Mutates."""
        return self.leases.grant(match.nodes, ttl_s)

    def lease_keys(self, lease_id: str) -> tuple[bytes, ...]:
        """The block keys a live lease pins (empty if unknown)."""
        return self.leases.keys_of(lease_id)

    # -- eviction -----------------------------------------------------------------

    def evict(self, num_bytes: int) -> None:
        """Free at least `num_bytes` from the local tiers (least recently used unpinned blocks),
        after deleting what `forget` could not delete before."""
        num_bytes -= self._reclaim()
        if num_bytes <= 0:
            return
        victims = self._unlist(lambda: self.tree.evict(num_bytes))
        with self._memory_lock:
            for node in victims:
                self._drop_from_memory_locked(node.payload)
        for node in victims:  # outside the memory lock: disk deletes must not stall promotions
            for tier in self._local:
                tier.delete_block(node.key)
            self._counters.add("evictions.disk")

    def reserve_memory(self, size: int) -> None:
        """Memory-only store: evict whole blocks through the tree until `size` bytes fit.

        Raises:
            StoreFullError: `size` exceeds the budget, or the rest is pinned.
        """
        with self._memory_lock:
            while True:
                usage = self._memory.usage()
                capacity = usage.capacity_bytes or 0
                if size > capacity:
                    raise StoreFullError(f"{size} B of new blocks exceed the memory tier's {capacity} B")
                if usage.used_bytes + size <= capacity:
                    return
                victims = self._unlist(functools.partial(self.tree.evict, usage.used_bytes + size - capacity))
                if not victims:
                    raise StoreFullError(
                        "memory tier is full of pinned blocks and there is no disk tier; nothing was kept"
                    )
                for node in victims:
                    self.memory_evictions += self._memory.chunks_held(node.key)
                    self._drop_from_memory_locked(node.payload)

    def put_in_memory(self, meta: BlockMeta, chunks: Sequence[bytes | memoryview]) -> bool:
        """Put a whole block in memory, making room first when memory is a cache. False if it
        does not fit (the rest is pinned, or it exceeds the budget)."""
        size = sum(len(c) for c in chunks)
        with self._memory_lock:
            if size > self._memory.capacity_bytes:
                return False
            self._drop_from_memory_locked(meta)
            self._make_room_locked(size)
            try:
                self._memory.put_block(meta, chunks)
            except TierFullError:
                return False
            for index in range(len(chunks)):
                self._policy.touch((meta.key, index), meta)
            self._memory_changed_locked(meta.key, meta)
            return True

    def put_pending(
        self, root: RootId, meta: BlockMeta, records: Sequence[bytes | memoryview | None], reserve: int = 0
    ) -> Pin | None:
        """Put a whole block in memory and list it, pinned until its disk write is done (`settle`):
        neither memory nor disk eviction may take a block memory holds the only copy of. One
        step under the memory lock, so no eviction sees it listed and unpinned, or held and
        unlisted. None (nothing kept, nothing listed) if memory cannot hold it. Records that are
        None come later (deferred summaries, `promote`d): `reserve` bytes are made room for them."""
        size = sum(len(c) for c in records if c is not None)
        with self._memory_lock:
            if size + reserve > self._memory.capacity_bytes:
                return None
            self._drop_from_memory_locked(meta)
            self._make_room_locked(size + reserve)
            try:
                self._memory.put_block(meta, records)
            except TierFullError:
                return None
            with self._listen_lock:
                parent = None if meta.depth == 0 else meta.parent
                node = self.tree.insert(root, parent, meta.tokens, meta.key, meta.nbytes, meta)
                pin = self.tree.pin([node])
                if self._listener is not None:
                    self._listener.blocks_listed((meta,))
            for index, record in enumerate(records):
                if record is not None:
                    self._policy.touch((meta.key, index), meta)
            self._memory_changed_locked(meta.key, meta)
            return pin

    def settle(self, pin: Pin) -> BlockMeta | None:
        """A pending block's disk write is done or abandoned: unpin it. Returns its metadata as
        listed now (scores may have been reported meanwhile), or None if it was unlisted."""
        self.tree.unpin(pin)
        return self.listed(pin)

    def listed(self, pin: Pin) -> BlockMeta | None:
        """The current metadata of the block `pin` holds, or None if that node left the tree."""
        node = pin.nodes[0]
        return node.payload if self.tree.get(node.key) is node else None

    def promote(self, meta: BlockMeta, index: int, data: bytes | memoryview) -> bool:
        """Copy one chunk read from a slower tier into memory, making room. False if it does not fit."""
        return self.promote_many(meta, [(index, data)]) == 1

    def promote_many(self, meta: BlockMeta, records: Sequence[tuple[int, bytes | memoryview]]) -> int:
        """Copy records (index, bytes) of one block read from a slower tier into memory: one step
        under the memory lock, room made once for all of them, the block's news told once, so a
        load pays one call per block. Returns how many memory holds now (it stops at the first
        that does not fit)."""
        with self._memory_lock:
            fresh = [(i, data) for i, data in records if not self._memory.has_chunk(meta.key, i)]
            held = len(records) - len(fresh)
            if not fresh:
                return held
            self._make_room_locked(sum(len(data) for _, data in fresh))
            for index, data in fresh:
                if not self._memory.put_chunk(meta, index, data):
                    break
                self._policy.touch((meta.key, index), meta)
                held += 1
            self._memory_changed_locked(meta.key, meta)
            return held

    def touch_memory(self, meta: BlockMeta, indices: Iterable[int]) -> None:
        """Record reads of memory chunks (the policy's frequency and recency)."""
        with self._memory_lock:
            for index in indices:
                self._policy.touch((meta.key, index), meta)

    def _make_room_locked(self, size: int) -> None:
        usage = self._memory.usage()
        used, capacity = usage.used_bytes, self._memory.capacity_bytes
        if not self._memory_is_cache or used + size <= capacity:
            return
        for ref in self._policy.victims():
            if self.tree.is_pinned(ref[0]):
                continue
            self._policy.remove(ref)
            freed = self._memory.delete_chunk(*ref)
            if freed:
                self.memory_evictions += 1
                used -= freed
                self._memory_changed_locked(ref[0])
            if used + size <= capacity:
                return

    def _drop_from_memory_locked(self, meta: BlockMeta) -> None:
        for index in range(meta.num_chunks):
            self._policy.remove((meta.key, index))
        self._memory.delete_block(meta.key)
        self._memory_changed_locked(meta.key)
