"""Key summaries of acknowledged blocks, encoded off the Store's thread (issue #40, item 3).

A layered block's 2-bit key summaries were most of a Store's time (float32 conversion,
quantisation, packing: ~60 % of a 2,048-token SmolLM2 store). A full load never reads them;
only a query-aware load does, and only after the Store was acknowledged. So with the disk
write-behind a Store encodes the layer pack (what a full load reads) and is acknowledged;
the summaries are encoded by whoever needs them first:

- the disk's group commit, before it writes the block (kvstore/store/commit.py): the disk
  and the remote tier only ever get whole blocks;
- a query-aware load that reaches the block first (kvstore/load/layer_by_layer.py): it
  encodes them on its own thread instead of waiting for the commit's turn;
- a Store whose blocks memory cannot hold, before writing them through.

Each block's summaries are encoded once (a lock per block), then put in the memory tier
where the block's pack already is (the block is pinned until its commit, so neither can be
evicted meanwhile). Where memory has no room left for them the commit still writes them to
disk; a query-aware load that comes before that finds the block in no tier and treats it as
a miss (never wrong KV). The Store's caller may reuse its KV buffer once acknowledged: the
keys are taken back from the block's own layer records (immutable bytes this process wrote),
not from the caller's buffer, which also spares the Store a copy of them.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable

from kvstore.format.block_meta import BlockMeta
from kvstore.format.key_summary import encode_summaries, encode_threads, summary_record_bytes
from kvstore.format.layered_block import keys_of_block
from kvstore.model import ModelSpec

logger = logging.getLogger(__name__)

#: Puts one finished record in the memory tier (StoreIndex.promote); False: no room.
PutRecord = Callable[[BlockMeta, int, bytes], bool]


class DeferredSummaries:
    """One block's summary records, to be encoded once; see module docstring. Thread-safe.

    Args:
        meta: the block (layered).
        records: the block's records, its summary slots (0 .. layers-1) holding None until `finish`
            (typed as what they hold after); the keys are taken back from its layer records.
        model: the block's model (dtype, kv heads, head dim).
    """

    def __init__(self, meta: BlockMeta, records: list[bytes | memoryview], model: ModelSpec) -> None:
        self.meta = meta
        #: Bytes of the summaries `finish` makes (memory makes room for them with the block).
        self.nbytes = self.record_bytes(meta, model)
        self._records = records
        self._model = model
        self._done = False
        self._lock = threading.Lock()

    @staticmethod
    def record_bytes(meta: BlockMeta, model: ModelSpec) -> int:
        """Bytes of the summaries `finish` will make for `meta` (its `nbytes` counts them ahead)."""
        return meta.num_layers * summary_record_bytes(meta.num_tokens, model.num_kv_heads, model.head_dim)

    def finish(self, put: PutRecord | None = None) -> bool:
        """Encode the summaries into the records if not done yet; with `put`, also hand each to it
        (the memory tier). Returns False if `put` refused one (no room)."""
        with self._lock:
            if self._done:
                return True
            ids = [self.meta.chunk_id(layer) for layer in range(self.meta.num_layers)]
            summaries = encode_summaries(ids, keys_of_block(self.meta, self._records, self._model))
            self._records[: len(summaries)] = summaries
            self._done = True
            if put is None:
                return True
            return all([put(self.meta, layer, data) for layer, data in enumerate(summaries)])


class SummaryJobs:
    """The blocks whose summaries are not encoded yet, by block key. Thread-safe.

    Args:
        put: where finished summaries go (the memory tier, through the index).
    """

    def __init__(self, put: PutRecord) -> None:
        self._put = put
        self._jobs: dict[bytes, DeferredSummaries] = {}
        self._lock = threading.Lock()

    def add(self, job: DeferredSummaries) -> None:
        """Register a block's job (before the block is listed, so no load can miss it)."""
        with self._lock:
            self._jobs[job.meta.key] = job

    def finish(self, key: bytes) -> bool:
        """Encode block `key`'s summaries now if they are pending (a load needs them); False if
        memory had no room for them. True at once when nothing is pending for it."""
        with self._lock:
            job = self._jobs.get(key)
        return True if job is None else self.finish_job(job)

    def finish_job(self, job: DeferredSummaries, to_memory: bool = True) -> bool:
        """`finish` of a job the caller holds (the commit, or a write-through Store)."""
        ok = job.finish(self._put if to_memory else None)
        self.drop(job)
        return ok

    def drop(self, job: DeferredSummaries) -> None:
        """Forget a job (finished, or its block abandoned)."""
        with self._lock:
            if self._jobs.get(job.meta.key) is job:
                del self._jobs[job.meta.key]

    def is_pending(self, job: DeferredSummaries) -> bool:
        """Whether `job` is still registered (not finished, not dropped with its block)."""
        with self._lock:
            return self._jobs.get(job.meta.key) is job

    def finish_all(self) -> None:
        """Encode every pending block's summaries now (benchmarks that time the disk alone)."""
        with self._lock:
            jobs = list(self._jobs.values())
        for job in jobs:
            self.finish_job(job)

    def pending(self) -> int:
        """How many blocks wait for their summaries."""
        with self._lock:
            return len(self._jobs)


class EncodeAhead:
    """Encodes the summaries of the next group commit's blocks on a thread of its own, in order,
    while the commit before it is written (kvstore/store/commit.py hands them over): the LMDB
    transaction (its writes and sync release the GIL) overlaps the encoding of the blocks after it,
    where the writer alone did one, then the other. The commit still calls `finish_job` on every
    block: a block the encoder has not reached yet it encodes itself, one it is encoding it waits
    for (the job's lock), so the disk and the remote tier still only get whole blocks, in order.
    A block is never encoded before a commit is under way (a Store's summaries stay behind it).
    Thread-safe.

    Args:
        jobs: the store's pending summaries (finished ones go to the memory tier, as the commit's).
        name: the thread's name.
    """

    def __init__(self, jobs: SummaryJobs, name: str) -> None:
        self._jobs = jobs
        self._queue: collections.deque[DeferredSummaries] = collections.deque()
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: DeferredSummaries) -> None:
        """Encode `job` once the jobs before it are done (unless the commit comes first)."""
        with self._cond:
            if not self._closed:
                self._queue.append(job)
                self._cond.notify()

    def close(self) -> None:
        """Stop (what is left is the commit's to encode) and wait for the job under way. Idempotent."""
        with self._cond:
            self._closed = True
            self._queue.clear()
            self._cond.notify()
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                job = self._queue.popleft()
            if not self._jobs.is_pending(job):  # the commit came first, or the block was abandoned
                continue
            try:
                self._jobs.finish_job(job)
            except Exception:  # the commit encodes it again, and fails the group commit with the reason
                logger.debug("kvsieve: encoding summaries ahead of the commit failed", exc_info=True)


def encode_on_one_thread() -> None:
    """For a process whose only torch work is encoding summaries (the sidecar: it runs no model):
    encoding runs on the disk writer and on loads' threads beside the RPCs, and torch's default
    pool spins for cores that are busy; see `kvstore.format.key_summary.encode_threads`."""
    encode_threads(1)
