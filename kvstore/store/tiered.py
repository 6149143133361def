"""TieredStore: the embedded `PrefixStore` over memory, disk and remote tiers.

A thin composition: `StoreIndex` (kvstore/index/store_index.py) keeps the bookkeeping (radix
tree, leases, eviction of every local tier), `plan_load` (kvstore/load/plan.py)
chooses the chunks a budget reads, `BlockWriter` (kvstore/store/write.py) encodes
and writes new blocks and `BlockReader` (kvstore/load/read.py) reads, verifies
and promotes them. The index lists a block only after its data is
durable in the slowest local tier, so a lookup never promises data that a crash
could lose; the new blocks of one `store` call go to disk in one transaction.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Set
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from importance.history import accumulate, decay_factor
from importance.layout import DEFAULT_MIN_CHANGE, layout_change
from kvstore.api import Lease, StoreInfo, Tokens
from kvstore.budget import Budget, resolve_budget
from kvstore.config import StoreConfig
from kvstore.errors import InvalidInputError
from kvstore.format.block_meta import BlockMeta
from kvstore.index.leases import LeaseTable
from kvstore.index.listener import BlockListener
from kvstore.index.store_index import StoreIndex
from kvstore.keys import Root, as_token_array, namespace_digest
from kvstore.load.buffers import keep_large_buffers
from kvstore.load.layer_by_layer import LocalLayeredLoad, open_layered
from kvstore.load.plan import plan_load, skip_blocks
from kvstore.load.read import BlockReader
from kvstore.load.stream import LocalLoadStream
from kvstore.model import ModelSpec
from kvstore.stats import Counters, StoreStats
from kvstore.store.write import BlockWriter
from kvstore.tiers import create_tier
from kvstore.tiers.arena import HostArena
from kvstore.tiers.base import Tier
from kvstore.tiers.disk.lock import DataDirLock
from kvstore.tiers.memory import MemoryTier, arena_bytes, memory_arena
from kvstore.tiers.pinned import cuda_available
from kvstore.tiers.stack import TierStack
from kvstore.values import DEFAULT_NAMESPACE, Array, LookupResult, StoreResult, validate_kv
from radix import MatchResult, RadixTree

if TYPE_CHECKING:
    from kvstore.tiers.remote.link import RemoteLink


class TieredStore:
    """The embedded `kvstore.api.PrefixStore` (the contract is documented there). Thread-safe.

    Args:
        config: tiers, budgets, block and chunk size.
        clock: lease expiry clock (monotonic seconds); injected by tests.
    """

    def __init__(
        self, config: StoreConfig | None = None, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config or StoreConfig()
        keep_large_buffers()  # chunk buffers are reused, not faulted in afresh per load
        self.counters = Counters()
        self._lock = None
        if self.config.lmdb_dir is not None:  # a reader that cannot be had, refused before anything opens
            from kvstore.tiers.disk.spans import check_reader

            check_reader(self.config.disk_reader)
        if self.config.data_dir is not None:
            self._lock = DataDirLock(
                self.config.data_dir, exclusive=False, purpose="opening a store"
            ).acquire()
        #: The memory tier's arena and the thread that makes its segments ahead (None: no arena,
        #: or `warm_read_ahead_bytes` 0); cold loads' reads land in that arena.
        self.arena_ahead = memory_arena(self.config)
        local: list[Tier] = []
        if self.config.lmdb_dir is not None:
            local.append(
                create_tier(
                    "lmdb",
                    path=self.config.lmdb_dir,
                    capacity_bytes=self.config.disk_bytes,
                    # what cold loads read, the memory tier keeps: as much warm memory as it holds
                    warm_read_bytes=self._warm_read_bytes(),
                    warm_ahead=self.arena_ahead,
                    disk_reader=self.config.disk_reader,
                )
            )
        memory = MemoryTier(
            self.config.memory_bytes,
            self.config.pin_host_memory,
            self.arena_ahead.arena if self.arena_ahead is not None else self._arena(),
            self.config.host_arena is not False,
        )
        self.remote_link: RemoteLink | None = None
        if self.config.has_remote:
            from kvstore.tiers.remote.link import open_link  # imports redis only when a remote tier is used

            self.remote_link = open_link(self.config, self.counters)
        self.index = StoreIndex(
            self.config, memory, local, counters=self.counters, clock=clock,
            # Only a cache of a durable tier may give up chunks the index still lists.
            memory_is_cache=bool(local) or self.config.has_remote,
        )  # fmt: skip
        self.tiers = TierStack(memory, tuple(local), self.remote_link)
        self.reader = BlockReader(self.config, self.index, self.tiers, self.counters)
        self.writer = BlockWriter(self.config, self.index, self.tiers, self.counters)
        # The parts, for the sidecar, tools and tests (read-only use).
        self.tree: RadixTree = self.index.tree
        self.leases: LeaseTable = self.index.leases
        self.memory: MemoryTier = memory
        self.durable: list[Tier] = list(self.tiers.durable)
        self._local_only = self.remote_link is None  # lookups never leave the process
        self._write_lock = threading.Lock()
        self._closed = False
        # A restarted store is warm: list every block of the local disk tier.
        self.orphans = self.index.rebuild(self.writer.local_metas())

    # -- PrefixStore ----------------------------------------------------------------

    @property
    def info(self) -> StoreInfo:
        layered = self.config.layout == "layered"  # new blocks select chunks of this size
        chunk = self.config.layer_chunk_tokens if layered else self.config.chunk_tokens
        return StoreInfo(self.config.block_tokens, chunk)

    def lookup(self, tokens: Tokens, *, model: ModelSpec, namespace: str = DEFAULT_NAMESPACE) -> LookupResult:
        match = self._match(self._root(model, namespace), as_token_array(tokens))
        self.counters.add_many({"lookups": 1, "lookup_hits": int(match.num_tokens > 0)})
        in_memory = self.memory.count_present(n.key for n in match.nodes)
        return LookupResult(match.num_tokens, len(match.nodes), in_memory)

    def lookup_many(self, token_lists: Array, *, model: ModelSpec, namespace: str = DEFAULT_NAMESPACE) -> int:
        """How many rows of `token_lists` (k, n), from the first, are cached whole, each looked up
        from the root on its own (pages filed as root-level blocks): one lock and one walk of the
        index for all of them. Where the local index ends, blocks other sidecars put in the
        remote tier are learned row by row, as `lookup` does."""
        lists = np.asarray(token_lists)
        if lists.ndim != 2 or lists.shape[1] == 0:
            raise InvalidInputError(f"token_lists must have shape (lists, tokens > 0), got {lists.shape}")
        root = self._root(model, namespace)
        held = self.index.tree.leading_whole(root, lists)
        if not self._local_only:  # the rest may be in the remote tier
            n = lists.shape[1]
            while held < len(lists) and self._match(root, as_token_array(lists[held])).num_tokens >= n:
                held += 1
        self.counters.add_many({"lookups": 1, "lookup_hits": int(held > 0)})
        return held

    def store(
        self,
        tokens: Tokens,
        kv: Array,
        *,
        model: ModelSpec,
        namespace: str = DEFAULT_NAMESPACE,
        scores: Array | None = None,
        kv_start: int = 0,
    ) -> StoreResult:
        toks = as_token_array(tokens)
        b = self.config.block_tokens
        if not isinstance(kv_start, int) or kv_start < 0 or kv_start % b or kv_start > len(toks):
            raise InvalidInputError(
                f"kv_start must be a multiple of block_tokens ({b}) in [0, {len(toks)}], got {kv_start!r}"
            )
        kv, scores = validate_kv(toks[kv_start:], kv, scores, model)
        root = self._root(model, namespace)
        num_blocks = len(toks) // b
        with self._write_lock:
            match = self.index.match(root, toks, touch=False)
            if len(match.nodes) < kv_start // b:  # a block before the KV we have is gone
                return StoreResult(match.num_tokens, 0, 0)
            with self.index.held(match.nodes):  # the parent chain must survive eviction
                encoded = self.writer.encode_blocks(
                    toks, kv, scores, kv_start, len(match.nodes), model, root, namespace
                )
                written = self.writer.write_blocks(encoded, model, root)
        new_blocks = num_blocks - len(match.nodes)
        self.counters.add("stores")
        self.counters.add("blocks_written", new_blocks)
        return StoreResult(num_blocks * b, new_blocks, written)

    def load(
        self,
        tokens: Tokens,
        *,
        model: ModelSpec,
        namespace: str = DEFAULT_NAMESPACE,
        budget: Budget = 1.0,
        budget_tokens: int | None = None,
        coverage: float | None = None,
        start_token: int = 0,
    ) -> LocalLoadStream:
        """`PrefixStore.load`; `start_token` (whole blocks, this store only) skips the blocks before
        it: the engine computes that head of the prefix while the rest loads (a split)."""
        toks = as_token_array(tokens)
        resolved = resolve_budget(budget, budget_tokens, coverage)
        block = self.config.block_tokens
        if not isinstance(start_token, int) or start_token < 0 or start_token % block:
            raise InvalidInputError(
                f"start_token must be a multiple of block_tokens ({block}), got {start_token!r}"
            )
        plan = skip_blocks(
            plan_load(self._match(self._root(model, namespace), toks), resolved), start_token // block
        )
        stream = LocalLoadStream(
            plan.matched_tokens, plan.selected_tokens, model.token_bytes, block,
            self.reader.read_blocks(plan, model), functools.partial(self._load_finished, model.token_bytes),
            plan.prefix_bytes, plan.estimated_coverage, first_token=min(start_token, plan.matched_tokens),
        )  # fmt: skip
        self.counters.add("loads")
        return stream

    def open_layers(
        self, tokens: Tokens, *, model: ModelSpec, namespace: str = DEFAULT_NAMESPACE
    ) -> LocalLayeredLoad:
        match = self._match(self._root(model, namespace), as_token_array(tokens))
        return open_layered(
            self.reader.layer_records, self.index, match, model, self.config.layer_chunk_tokens,
            self.counters, self.writer.summaries.finish,
        )  # fmt: skip

    def load_arrays(self, tokens: Tokens, **kwargs: Any) -> tuple[int, Array, Array]:
        """`load`, gathered: (prefix tokens covered, positions (n,), kv (L, 2, H, n, D))."""
        stream = self.load(tokens, **kwargs)
        positions, kv = stream.gather(kwargs["model"])
        return stream.num_tokens, positions, kv

    def pin(
        self, tokens: Tokens, *, model: ModelSpec, namespace: str = DEFAULT_NAMESPACE, ttl_s: float = 60.0
    ) -> Lease:
        match = self.index.match(self._root(model, namespace), as_token_array(tokens), touch=False)
        return self.index.grant(match, ttl_s)

    def unpin(self, lease_id: str) -> None:
        self.index.leases.release(lease_id)

    def report_scores(
        self, tokens: Tokens, scores: Array, *, model: ModelSpec, namespace: str = DEFAULT_NAMESPACE
    ) -> int:
        toks = as_token_array(tokens)
        values = np.asarray(scores, dtype=np.float32)
        if values.shape != (len(toks),) or not np.all(np.isfinite(values)):
            raise InvalidInputError(f"scores must be {len(toks)} finite floats, got shape {values.shape}")
        match = self.index.match(self._root(model, namespace), toks, touch=False)
        decay = decay_factor(self.config.score_half_life_reports)
        b = self.config.block_tokens
        drifted = 0
        for i, node in enumerate(match.nodes):
            meta: BlockMeta = node.payload
            updated = replace(meta, scores=accumulate(meta.scores, values[i * b : (i + 1) * b], decay))
            self.writer.put_meta(updated)
            self.index.update(node, updated)
            drifted += _newly_drifted(meta, updated)
        self.counters.add_many({"score_reports": 1, "layout_drifted_blocks": drifted})
        return len(match.nodes)

    def warm_reads(self, ahead_bytes: int, wait_s: float = 0.0) -> bool:
        """Fault in `ahead_bytes` of memory for the local disk tiers' reads now, in the background,
        and keep that much ready (kvstore/tiers/disk/pread.py `WarmRanges`; the memory tier's arena
        where it has one). With `wait_s`, wait up to that long for it (a benchmark's restarted
        store, idle as a sidecar is after its start); False if it was not made within it."""
        makers = [] if self.arena_ahead is None else [self.arena_ahead]
        for tier in self.tiers.durable:
            warm = getattr(tier, "warm_reads", None)
            if warm is not None and (made := warm(ahead_bytes)) is not None:
                makers.append(made)
        if self.arena_ahead is not None:
            self.arena_ahead.keep_ahead(max(ahead_bytes, self.arena_ahead.ahead_bytes))
        return all(maker.wait(wait_s) for maker in makers) if wait_s else True

    def stats(self) -> StoreStats:
        self.leases.sweep()
        counters, samples = self.counters.snapshot()
        counters["leases_expired"] = self.leases.expired_total
        counters["evictions.memory"] = self.index.memory_evictions
        if self.remote_link is not None:
            counters |= self.remote_link.counters()
        if self.writer.behind is not None:
            counters |= self.writer.behind.counters()
        tiers = {t.name: t.usage() for t in self.tiers.all}
        return StoreStats(counters, tiers, self.tree.num_blocks, len(self.leases), samples)

    def flush(self, timeout_s: float = 60.0) -> bool:
        """Wait until every acknowledged block is on disk (the write-behind backlog committed) and
        the remote tier's queue has been attempted (it is fed after each commit). True if both
        emptied within `timeout_s`; the disk part is done at once with `sync_stores` or no disk."""
        deadline = time.monotonic() + timeout_s
        done = self.writer.behind is None or self.writer.behind.flush(timeout_s)
        if self.remote_link is not None:
            done = self.remote_link.flush(max(0.0, deadline - time.monotonic())) and done
        return done

    def close(self) -> None:
        """Commit the disk backlog, drain the remote queue, close the tiers. Idempotent."""
        if not self._closed:
            self._closed = True
            if self.writer.behind is not None:
                self.writer.behind.close()  # before the remote link: a commit feeds its queue
            if self.remote_link is not None:
                self.remote_link.close()  # drains queued remote writes first
            for tier in self.tiers.all:
                tier.close()
            if self.arena_ahead is not None:
                self.arena_ahead.close()
            if self._lock is not None:
                self._lock.release()

    # -- what the sidecar asks (kvstore.server.backend.SidecarStore) ---------------

    @property
    def local_only(self) -> bool:
        return self._local_only

    def lease_keys(self, lease_id: str) -> tuple[bytes, ...]:
        return self.index.lease_keys(lease_id)

    def block_bytes(self, key: bytes) -> int:
        return self.index.block_bytes(key)

    def namespace_usage(self, namespace_digests: Set[bytes]) -> tuple[int, int]:
        blocks = nbytes = 0
        for node in self.tree.nodes():
            if node.root[0] in namespace_digests:  # type: ignore[index]  # roots are (namespace, model)
                blocks += 1
                nbytes += node.nbytes
        return blocks, nbytes

    def watch(self, listener: BlockListener | None) -> list[BlockMeta]:
        """Tell `listener` of every block listed or unlisted from now on (None stops it), and
        return the blocks listed now, parents before children: the snapshot a listener that
        starts late begins from (KV events for routers, kvstore/events)."""
        self.index.watch(listener)
        return self.listed_blocks()

    def keys_in_memory(self) -> set[bytes]:
        """The keys of the blocks held whole in memory where memory caches a durable tier."""
        return self.index.keys_in_memory()

    def listed_blocks(self) -> list[BlockMeta]:
        """The metadata of every listed block, parents before children."""
        nodes = sorted(self.tree.nodes(), key=lambda node: node.depth)
        return [node.payload for node in nodes]

    def pinnable_bytes(self) -> int | None:
        config = self.config
        if config.lmdb_dir is not None:
            return config.disk_bytes
        return None if self.durable else config.memory_bytes

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ----------------------------------------------------------------

    def _warm_read_bytes(self) -> int:
        """Warm memory the disk tier's reads may use: as much as the memory tier keeps of them."""
        if not self.config.warm_read_ahead_bytes or not self.config.memory_bytes:
            return 0
        return arena_bytes(self.config.memory_bytes)

    def _arena(self) -> HostArena | None:
        """The memory tier's arena where `host_arena` asks for one off CUDA and nothing is made ahead
        (the tier makes its own page-locked one where CUDA is)."""
        if not self.config.host_arena or cuda_available():
            return None
        return HostArena(arena_bytes(self.config.memory_bytes), pin=False)

    def _match(self, root: Root, toks: Array) -> MatchResult:
        """Match locally; where the local tree ends, learn blocks other sidecars put remotely."""
        match = self.index.match(root, toks)
        if self.writer.learn_remote(root, toks, match):
            return self.index.match(root, toks)
        return match

    def _load_finished(self, token_bytes: int, stream: LocalLoadStream) -> None:
        self.counters.add("bytes_selected", stream.selected_tokens * token_bytes)
        self.counters.sample_read_amplification(stream.read_amplification)

    def _root(self, model: ModelSpec, namespace: str) -> Root:
        return (namespace_digest(namespace), model.fingerprint)


def _newly_drifted(before: BlockMeta, after: BlockMeta) -> bool:
    """The report moved the block's ranking past DEFAULT_MIN_CHANGE from its layout (it is
    now due for `kvsieve relayout`; it keeps loading correctly, reading chunks by score)."""
    assert after.scores is not None
    was = 0.0 if before.scores is None else layout_change(before.scores, before.permutation)
    return was <= DEFAULT_MIN_CHANGE < layout_change(after.scores, after.permutation)
