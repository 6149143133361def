"""The disk behind the Store: acknowledged blocks go to LMDB in group commits on one thread.

A Store in write-behind mode (the default; `StoreConfig.sync_stores` off) puts its blocks
in memory, lists them pinned (kvstore/index/store_index.py `put_pending`: no eviction may
take a block memory holds the only copy of) and queues them here. The writer thread
(kvstore/tiers/behind.py) takes up to `commit_blocks` of them (and at most a quarter of
`disk_backlog_bytes`, so that Stores queue the next commit while one is written), or what
came within `commit_ms` of the first, and writes them in one LMDB transaction: one sync for
all. The layered layout's deferred summaries of the blocks queued behind a commit are
encoded on a second thread while it is written (kvstore/store/deferred.py `EncodeAhead`).
Then it unpins them and hands them to the shared remote tier's queue, so the remote
tier, as before, only ever gets blocks the local disk holds.

What a crash does: LMDB commits whole transactions, and a transaction holds whole
blocks, so after SIGKILL or power loss every block is on disk whole or not at all; the
queue is in submission order, so a block's parent is committed with it or before it, and
the index rebuilt at restart (from the disk) lists only what is there. The unflushed
backlog is lost: misses after the restart, never wrong KV (docs/reliability.md).

A commit that fails (disk full, I/O error) is retried every `_RETRY_S` while memory
keeps serving the blocks; the backlog it leaves is in the stats (`disk_backlog_*`), and
once it passes `disk_backlog_bytes` Stores wait `backlog_wait_s`, then are refused with
RESOURCE_EXHAUSTED. Close writes what is queued; what still fails then is counted lost.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import NamedTuple

from kvstore.config import StoreConfig
from kvstore.errors import LimitExceededError, StoreFullError, TierFullError
from kvstore.format.block_meta import BlockMeta
from kvstore.index.store_index import StoreIndex
from kvstore.stats import Counters
from kvstore.store.deferred import DeferredSummaries, EncodeAhead, SummaryJobs
from kvstore.tiers.base import Tier
from kvstore.tiers.behind import BehindQueue
from kvstore.tiers.stack import TierStack
from radix.tree import Pin

logger = logging.getLogger(__name__)
Block = tuple[BlockMeta, Sequence[bytes | memoryview]]
_RETRY_S = 0.5  # pause before a failed group commit is tried again


class Pending(NamedTuple):
    """A block acknowledged from memory, waiting for the disk."""

    meta: BlockMeta
    records: Sequence[bytes | memoryview]  # as the disk stores them (a raw pack: a read-only memoryview)
    pin: Pin  # keeps it listed and in memory until the commit (StoreIndex.put_pending)
    summaries: DeferredSummaries | None = None  # fills `records`' summary slots (deferred.py)


def put_durable(tier: Tier, blocks: Sequence[Block], index: StoreIndex) -> int:
    """Write `blocks` to a local durable tier in one transaction, evicting least recently used
    unpinned blocks first when its budget is short. Returns the bytes written.

    Raises:
        StoreFullError: the budget is held by pinned blocks, or the disk is full.
    """
    needed = sum(meta.nbytes for meta, _ in blocks)
    usage = tier.usage()
    if usage.capacity_bytes is not None and usage.used_bytes + needed > usage.capacity_bytes:
        index.evict(usage.used_bytes + needed - usage.capacity_bytes)
        usage = tier.usage()
        if usage.used_bytes + needed > (usage.capacity_bytes or 0):
            raise StoreFullError(
                f"{tier.name} tier budget of {usage.capacity_bytes} B is held by pinned blocks "
                f"({usage.used_bytes} B used, {needed} B needed); nothing of this call was kept"
            )
    try:
        tier.put_blocks(blocks)
    except TierFullError:
        index.evict(max(needed, (usage.capacity_bytes or 0) // 10))
        try:
            tier.put_blocks(blocks)
        except TierFullError as exc:
            raise StoreFullError(f"{tier.name} tier is full: {exc}") from exc
    return needed


class DiskBehind:
    """The disk write-behind of one store; see module docstring. Thread-safe.

    Args:
        config: commit_blocks, commit_ms, disk_backlog_bytes, backlog_wait_s.
        index: pins and unpins pending blocks, evicts to make room on disk.
        tiers: the local durable tiers written, and the remote tier fed after each commit.
        counters: the store's counters (`bytes_written.<tier>`, `disk_commits`, ...).
    """

    def __init__(
        self, config: StoreConfig, index: StoreIndex, tiers: TierStack, counters: Counters, jobs: SummaryJobs
    ) -> None:
        self._config, self._index, self._tiers, self._counters = config, index, tiers, counters
        self._jobs = jobs  # deferred summaries: encoded here before a block is written, if not yet
        self._queue = BehindQueue[Pending](
            self._commit, config.disk_backlog_bytes, batch_items=config.commit_blocks,
            batch_s=config.commit_ms / 1e3, retry_s=_RETRY_S, on_failure=self._abandon,
            # A quarter of the backlog a commit: Stores queue the next ones while it is written.
            batch_bytes=max(1, config.disk_backlog_bytes // 4), name="kvsieve-disk-commit",
        )  # fmt: skip
        self._ahead = EncodeAhead(jobs, "kvsieve-summaries")  # summaries overlap the commits
        self._committing = False  # a group commit is under way (read unlocked: a hint)

    def fits_budget(self, size: int) -> bool:
        """Whether `size` bytes fit the disk budget at all (a Store that cannot is refused by the
        synchronous path, with the reason, instead of being acknowledged and never committed)."""
        budget = self._budget()
        return budget is None or size <= budget

    def make_room(self, size: int) -> None:
        """Where the disk has a budget, make room for `size` more bytes beside what is on disk and
        in the backlog now, evicting least recently used unpinned blocks, as a synchronous Store
        would: a Store the budget cannot take is refused now, not acknowledged and never committed.

        Raises:
            StoreFullError: pinned blocks (leases, or a backlog that does not drain within
                `backlog_wait_s`) hold the budget.
        """
        for tier in self._tiers.local_durable:
            if self._over_budget(tier, size) > 0:
                self._index.evict(self._over_budget(tier, size))
            if self._over_budget(tier, size) > 0 and self._queue.flush(self._config.backlog_wait_s):
                self._index.evict(self._over_budget(tier, size))  # the backlog is evictable now
            usage = tier.usage()
            if self._over_budget(tier, size) > 0:
                raise StoreFullError(
                    f"{tier.name} tier budget of {usage.capacity_bytes} B is held by pinned blocks "
                    f"({usage.used_bytes} B used, {self._queue.stats().pending_bytes} B waiting to be "
                    f"written, {size} B needed); nothing of this call was kept"
                )

    def _over_budget(self, tier: Tier, size: int) -> int:
        """Bytes by which the tier's budget is short for `size` more beside the backlog."""
        usage = tier.usage()
        if usage.capacity_bytes is None:
            return 0
        return usage.used_bytes + self._queue.stats().pending_bytes + size - usage.capacity_bytes

    def admit(self, size: int) -> None:
        """Reserve `size` bytes of backlog for a Store, waiting up to `backlog_wait_s`.

        Raises:
            LimitExceededError: no room came in time (RESOURCE_EXHAUSTED on the wire).
        """
        if self._queue.admit(size, self._config.backlog_wait_s):
            return
        stats = self._queue.stats()
        self._counters.add("disk_backlog_refusals")
        raise LimitExceededError(
            f"the disk write-behind backlog is full: {stats.pending_bytes} B acknowledged and not yet "
            f"on disk, {size} B more would pass disk_backlog_bytes={self._config.disk_backlog_bytes} "
            f"after waiting backlog_wait_s={self._config.backlog_wait_s} s (the disk is slower than "
            "the stores, or failing: see disk_commit_failures); nothing of this call was kept, retry"
        )

    def release(self, size: int) -> None:
        """Give back backlog `admit` reserved for blocks that were not queued."""
        self._queue.release(size)

    def submit(self, pending: Pending) -> None:
        """Queue an admitted block for the next group commit."""
        if not self._queue.submit(pending, pending.meta.nbytes, admitted=True):  # closing
            self._abandon([pending])
        elif pending.summaries is not None and self._committing:  # encoded while that commit runs
            self._ahead.submit(pending.summaries)

    def flush(self, timeout_s: float) -> bool:
        """Wait until every queued block is committed (or given up on). True if in time."""
        return self._queue.flush(timeout_s)

    def close(self) -> None:
        """Commit everything queued (a failing commit gets one more try). Idempotent."""
        self._queue.close(None)
        self._ahead.close()

    def counters(self) -> dict[str, int]:
        """`disk_backlog_blocks` and `disk_backlog_bytes` (waiting now), `disk_commits`,
        `disk_commit_failures` (attempts retried), `disk_backlog_waits` (Stores that waited)."""
        s = self._queue.stats()
        return {
            "disk_backlog_blocks": s.pending_items, "disk_backlog_bytes": s.pending_bytes,
            "disk_commits": s.batches, "disk_commit_failures": s.retries, "disk_backlog_waits": s.waits,
        }  # fmt: skip

    def _commit(self, batch: list[Pending]) -> None:
        """One group commit (the worker's write): the blocks still listed, one transaction per
        group that fits the disk budget; each group unpinned once written, so that the next may
        evict it as a synchronous Store would. Raising leaves the batch queued (a group written
        already is written again then: the same bytes). Deferred summaries are encoded first: the
        disk and the remote tier only ever get whole blocks. The next commit's blocks are handed
        to the encoder thread first, to be encoded while this one is written, and so are blocks
        submitted meanwhile (a block is never encoded ahead while no commit is under way)."""
        self._committing = True
        try:
            for p in self._queue.peek(self._config.commit_blocks):
                if p.summaries is not None:
                    self._ahead.submit(p.summaries)
            self._write_groups(batch)
        finally:
            self._committing = False

    def _write_groups(self, batch: list[Pending]) -> None:
        """`_commit`'s work: summaries, then one transaction per group within the disk budget."""
        for p in batch:
            if p.summaries is not None:
                self._jobs.finish_job(p.summaries)
        for group in _budget_groups(batch, self._budget()):
            live = [(meta, p.records) for p in group if (meta := self._index.listed(p.pin)) is not None]
            try:
                for tier in self._tiers.local_durable:
                    written = put_durable(tier, live, self._index) if live else 0
                    self._counters.add(f"bytes_written.{tier.name}", written)
            except Exception as exc:
                logger.warning("kvsieve: a group commit of %d blocks failed, retrying: %s", len(live), exc)
                raise
            self._rewrite_changed_metas(group, live)
            forgotten = [p.meta.key for p in group if self._index.settle(p.pin) is None]
            if forgotten:  # unlisted during the commit: nothing reaches them, they must not hold disk
                self._index.drop_unlisted(forgotten)
            if self._tiers.remote is not None:  # after the local commit; queued, never blocks
                for meta, records in live:
                    self._tiers.remote.write(meta, records)

    def _rewrite_changed_metas(self, group: list[Pending], written: list[Block]) -> None:
        """Scores reported while a block was being committed reached memory and the index but not
        the disk (it did not hold the block yet): write the metadata the index lists now."""
        metas = {meta.key: meta for meta, _ in written}
        for p in group:
            current = self._index.listed(p.pin)
            if current is not None and metas.get(current.key, current) is not current:
                for tier in self._tiers.local_durable:
                    tier.put_meta(current)

    def _budget(self) -> int | None:
        """The smallest byte budget of the local durable tiers (None: unbounded)."""
        budgets = [c for t in self._tiers.local_durable if (c := t.usage().capacity_bytes) is not None]
        return min(budgets, default=None)

    def _abandon(self, batch: list[Pending]) -> None:
        """Blocks the disk never took (failing at close): unlisted, so that nothing promises them."""
        for p in batch:
            if p.summaries is not None:
                self._jobs.drop(p.summaries)
            self._index.settle(p.pin)
            self._index.forget(p.meta.key)
        self._counters.add("disk_backlog_lost", len(batch))


def _budget_groups(batch: list[Pending], budget: int | None) -> list[list[Pending]]:
    """`batch` cut, in order, into groups of at most `budget` bytes (a larger block alone)."""
    if budget is None:
        return [batch]
    groups: list[list[Pending]] = [[]]
    size = 0
    for p in batch:
        if groups[-1] and size + p.meta.nbytes > budget:
            groups.append([])
            size = 0
        groups[-1].append(p)
        size += p.meta.nbytes
    return groups
