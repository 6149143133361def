"""BlockWriter: a store's bytes, from the caller to the tiers.

It encodes new blocks (each in importance order, or in the layered layout) and writes
them: local durable tiers first, in one transaction, then memory, then the index, then
the shared remote tier's queue. It also tells the index what the tiers already hold: the
local disk's blocks at start-up, and blocks other sidecars put in the remote tier. What
to evict to make room it asks the index; it never decides.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, NamedTuple, cast

import numpy as np

from importance.layout import importance_order
from kvstore.config import StoreConfig
from kvstore.errors import InvalidInputError, LimitExceededError, StoreFullError
from kvstore.format.block_meta import LAYERED, BlockMeta, layered_layout_version
from kvstore.format.chunk import ChunkId, encode_chunk
from kvstore.format.key_summary import prepare_encoding
from kvstore.format.layered_block import encode_layer_part, encode_layered, memory_record
from kvstore.index.store_index import StoreIndex
from kvstore.keys import ROOT_KEY, Root, block_keys
from kvstore.model import ModelSpec
from kvstore.stats import Counters
from kvstore.store.commit import DiskBehind, Pending, put_durable
from kvstore.store.deferred import DeferredSummaries, SummaryJobs
from kvstore.tiers.stack import TierStack
from kvstore.values import Array
from radix import MatchResult

if TYPE_CHECKING:  # kvstore.tiers.remote.link imports redis: only a store with a remote tier loads it
    from kvstore.tiers.disk.lmdb import LmdbTier


NewBlock = tuple[BlockMeta, list[bytes | memoryview]]  # a raw pack is a read-only memoryview


class Encoded(NamedTuple):
    """New blocks of one Store, and each one's deferred summaries (None: encoded already)."""

    blocks: list[NewBlock]  # a deferred block's summary slots are None until its job finishes
    jobs: list[DeferredSummaries | None]


MAX_RECORDS = 65535  # records per block: chunk indices are u16 in chunk keys (docs/keys.md)


class BlockWriter:
    """Encode and write new blocks; list what the tiers hold; see module docstring. Thread-safe.

    Args:
        config: the store's configuration (block and chunk size, codec, layout).
        index: decides eviction and lists what is held.
        tiers: the store's tiers.
        counters: the store's counters.
    """

    def __init__(self, config: StoreConfig, index: StoreIndex, tiers: TierStack, counters: Counters) -> None:
        self._config = config
        self._index = index
        self.tiers = tiers
        self._counters = counters
        #: Layered blocks' key summaries not encoded yet (write-behind only: kvstore/store/deferred.py).
        self.summaries = SummaryJobs(index.promote)
        # The disk write-behind, where there is a disk and stores are not synchronous.
        self.behind = (
            DiskBehind(config, index, tiers, counters, self.summaries)
            if tiers.local_durable and not config.sync_stores
            else None
        )
        if config.layout == LAYERED:
            prepare_encoding()

    def encode_blocks(
        self, toks: Array, kv: Array, scores: Array | None, kv_start: int, first: int,
        model: ModelSpec, root: Root, namespace: str,
    ) -> Encoded:  # fmt: skip
        """Encode blocks `first`.. of `toks` (KV from token `kv_start`), each in importance order or
        layered; with the disk write-behind a layered block's summaries are deferred (see
        kvstore/store/deferred.py)."""
        keys = block_keys(toks, self._config.block_tokens, model.fingerprint, root[0])
        encoded = Encoded([], [])
        for index in range(first, len(keys)):
            block, job = self._encode_block(toks, kv, scores, kv_start, keys, index, model, root, namespace)
            encoded.blocks.append(block)
            encoded.jobs.append(job)
        return encoded

    def write_blocks(self, encoded: Encoded, model: ModelSpec, root: Root) -> int:
        """Write new blocks; returns their bytes as the durable tiers store them.

        Write-behind (`self.behind` set): acknowledged once memory holds them and the index lists
        them, queued for the disk's next group commit (kvstore/store/commit.py). Otherwise, or for
        blocks memory cannot hold: local durable tiers first (all blocks in one transaction),
        then memory, then the index, then the shared tier's queue.
        """
        blocks, jobs = encoded
        if not blocks:
            return 0
        needed = sum(meta.nbytes for meta, _ in blocks)
        in_memory = [self._memory_block(block, model) for block in blocks]
        done = 0
        if self.behind is not None:
            if self.behind.fits_budget(needed):
                done = self._write_behind(self.behind, encoded, in_memory, root)
                if done == len(blocks):
                    return needed
            # What memory cannot hold (or the disk budget cannot take at once) goes to disk now,
            # after the backlog: a block's parent is never committed after it.
            for job in jobs[done:]:
                if job is not None:
                    self.summaries.finish_job(job, to_memory=False)
            blocks = blocks[done:]
            # the summaries just encoded, in the memory records (the rest are made already)
            in_memory = [
                (meta, [new if held is None else held for new, held in zip(records, memory, strict=True)])
                for (meta, records), (_, memory) in zip(blocks, in_memory[done:], strict=True)
            ]
            if not self.behind.flush(self._config.backlog_wait_s):
                raise LimitExceededError(
                    f"{len(blocks)} blocks fit neither memory nor the disk write-behind backlog, "
                    f"which did not drain in backlog_wait_s={self._config.backlog_wait_s} s; "
                    f"the first {done} blocks were kept"
                )
        self._write_through(blocks, in_memory, root)
        return needed

    def _memory_block(self, block: NewBlock, model: ModelSpec) -> NewBlock:
        """What memory holds of a new block: raw chunks (no zstd on the hot path), summaries as
        they are (a deferred block's None until encoded)."""
        meta, records = block
        if self._config.codec == "raw":
            return meta, list(records)
        return meta, [x if x is None else memory_record(x, model.dtype, meta) for x in records]

    def _write_behind(
        self, behind: DiskBehind, encoded: Encoded, in_memory: list[NewBlock], root: Root
    ) -> int:
        """Acknowledge blocks from memory and queue them for the disk, in order; returns how many
        (the first that memory cannot hold stops it). Raises `LimitExceededError` when the
        backlog has no room for them within `backlog_wait_s`."""
        sizes = [meta.nbytes for meta, _ in encoded.blocks]
        behind.make_room(sum(sizes))
        behind.admit(sum(sizes))
        for index, ((meta, records), (_, held), job) in enumerate(
            zip(encoded.blocks, in_memory, encoded.jobs, strict=True)
        ):
            if job is not None:  # before the block is listed: a load that finds it finds its job
                self.summaries.add(job)
            pin = self._index.put_pending(root, meta, held, reserve=0 if job is None else job.nbytes)
            if pin is None:
                if job is not None:
                    self.summaries.drop(job)
                behind.release(sum(sizes[index:]))
                return index
            self._counters.add("bytes_written.memory", _bytes(held))
            behind.submit(Pending(meta, records, pin, job))
        return len(encoded.blocks)

    def _write_through(self, blocks: list[NewBlock], in_memory: list[NewBlock], root: Root) -> None:
        """Today's order: durable tiers (one transaction), memory, the index, the remote queue."""
        for tier in self.tiers.local_durable:
            self._counters.add(f"bytes_written.{tier.name}", put_durable(tier, blocks, self._index))
        if not self.tiers.local_durable:  # memory is the only local copy: make room for all, or fail now
            self._index.reserve_memory(sum(len(x) for _, c in in_memory for x in c))
        for meta, chunks in in_memory:
            if self._index.put_in_memory(meta, chunks):
                self._counters.add("bytes_written.memory", sum(len(x) for x in chunks))
            elif not self.tiers.local_durable:  # cannot happen after reserve_memory: never list
                # what is not held
                raise StoreFullError("memory tier is full and there is no disk tier")
            self._index.insert(root, meta)
        if self.tiers.remote is not None:  # after the local commit; queued, never blocks
            for meta, chunks in blocks:
                self.tiers.remote.write(meta, chunks)

    def put_meta(self, meta: BlockMeta) -> None:
        """Replace a block's metadata in every tier that holds it (new scores)."""
        for tier in [self.tiers.memory, *self.tiers.durable]:
            tier.put_meta(meta)

    def local_metas(self) -> list[BlockMeta]:
        """Every block record of the local disk tier, for the start-up rebuild. Records that
        fail their checksum or identity check are skipped and counted (`metadata_failures`)."""
        if not self.tiers.local_durable:
            return []
        records = [m for _, m in cast("LmdbTier", self.tiers.local_durable[0]).iter_meta_raw()]
        self._counters.add("metadata_failures", sum(not isinstance(m, BlockMeta) for m in records))
        return [m for m in records if isinstance(m, BlockMeta)]

    def learn_remote(self, root: Root, toks: Array, match: MatchResult) -> int:
        """List the blocks after `match` that other sidecars put in the remote tier. Returns
        how many were learned (0 without a remote tier, or when `toks` has no further block)."""
        b = self._config.block_tokens
        if self.tiers.remote is None or len(toks) < match.num_tokens + b:
            return 0
        wanted = block_keys(toks, b, root[1], root[0])[len(match.nodes) :]
        learned = 0
        for key, meta in zip(wanted, self.tiers.remote.tier.get_metas(wanted), strict=True):
            if meta is None or meta.key != key or meta.num_tokens != b:
                break
            self._index.insert(root, meta)
            learned += 1
        if learned:
            self._counters.add("blocks_learned.redis", learned)
        return learned

    def _encode_block(
        self, toks: Array, kv: Array, scores: Array | None, kv_start: int, keys: list[bytes],
        index: int, model: ModelSpec, root: Root, namespace: str,
    ) -> tuple[NewBlock, DeferredSummaries | None]:  # fmt: skip
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
        chunks: list[bytes | memoryview] = []
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
        return (meta, chunks), None

    def _encode_layered(
        self, toks: Array, block_kv: Array, block_scores: Array | None, keys: list[bytes], index: int,
        model: ModelSpec, root: Root, namespace: str,
    ) -> tuple[NewBlock, DeferredSummaries | None]:  # fmt: skip
        """A block in the layered layout (kvstore/load/read_layered.py): prompt order, scores kept;
        with the disk write-behind its summaries are left to a job (kvstore/store/deferred.py)."""
        b, c = self._config.block_tokens, self._config.layer_chunk_tokens
        if model.num_layers * (1 + b // c) > MAX_RECORDS:  # record indices are u16 in chunk keys
            raise InvalidInputError(
                f"layer_chunk_tokens {c} gives {model.num_layers * (1 + b // c)} records per block of "
                f"{model.name}, more than {MAX_RECORDS}: use larger chunks"
            )
        parent = keys[index - 1] if index else ROOT_KEY
        version = layered_layout_version(c, self._config.layered_pack)
        meta = BlockMeta(
            keys[index], parent, model.fingerprint, root[0], index, toks[index * b : (index + 1) * b].copy(),
            c, version, np.arange(b, dtype=np.int64), block_scores, 0, time.time(),
            namespace, LAYERED, model.num_layers,
        )  # fmt: skip  # the chunk size is in the version: in every record's key and identity
        cfg = self._config
        if self.behind is None:  # synchronous stores encode everything now
            records = encode_layered(meta, block_kv, model.dtype, cfg.codec, cfg.zstd_level)
            return (replace(meta, nbytes=sum(len(x) for x in records)), records), None
        part = encode_layer_part(meta, block_kv, model.dtype, cfg.codec, cfg.zstd_level)
        meta = replace(meta, nbytes=DeferredSummaries.record_bytes(meta, model) + _bytes(part))
        deferred: list[bytes | None] = [None] * meta.num_layers
        records = cast("list[bytes | memoryview]", [*deferred, *part])  # the Nones: filled by the job
        return (meta, records), DeferredSummaries(meta, records, model)


def _bytes(records: Sequence[bytes | memoryview | None]) -> int:
    """Bytes of the records present (a deferred block's summaries are not, yet)."""
    return sum(len(x) for x in records if x is not None)
