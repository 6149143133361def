"""The offline re-layout job: re-order blocks whose importance ranking changed.

For each block whose top tokens (by its current scores, which real queries keep
updating) differ from its layout by more than `min_change` (1 - Jaccard of the
top-quarter sets), the job writes the block's chunks in the new order under a
new layout version, switches the metadata in the same transaction, then deletes
the old chunks in a second one. Killed at any point, every block is loadable in
its old or its new layout; old chunks left behind are swept by the next run.
It takes the data directory's lock exclusively: no server may run beside it.

Fault injection (tests only): with `KVSIEVE_FAULT=relayout-between-transactions`
in the environment, the job SIGKILLs itself right after the first block's new
layout is committed and before its old chunks are deleted, so a test can check
the state a real crash at that instant leaves (tests/test_relayout.py).
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from importance.layout import (
    DEFAULT_MIN_CHANGE,
    budget_to_tokens,
    chunks_for_top,
    importance_order,
    layout_change,
)
from kvstore.config import store_data_file, store_lmdb_dir
from kvstore.errors import ChecksumError
from kvstore.format.block_meta import LAYERED, BlockMeta, layered_layout_version
from kvstore.format.chunk import decode_chunk, encode_chunk
from kvstore.format.layer_record import decode_layer_record
from kvstore.format.layered_block import encode_layered
from kvstore.keys import parse_chunk_key
from kvstore.offline.progress import progress_bar
from kvstore.tiers.disk.lmdb import LmdbTier
from kvstore.tiers.disk.lock import DataDirLock


@dataclass
class RelayoutReport:
    """What the job found and did. Read amplification is the expected value at `fraction`.

    Layered blocks are never re-ordered (prompt order is their layout): they are counted
    in `layered_blocks_skipped`. `blocks_migrated` counts importance-layout blocks that
    `to_layered` rewrote in the layered layout, `blocks_repacked` layered blocks of layout v2
    (a value per layer record) it rewrote as packs (v3).
    """

    blocks_examined: int = 0
    blocks_scored: int = 0
    blocks_rewritten: int = 0
    bytes_written: int = 0
    stale_chunks_removed: int = 0
    corrupt_blocks_skipped: int = 0
    layered_blocks_skipped: int = 0
    blocks_migrated: int = 0
    blocks_repacked: int = 0
    read_amp_before: float = 1.0
    read_amp_after: float = 1.0
    dry_run: bool = False


def relayout(
    data_dir: str | Path,
    min_change: float = DEFAULT_MIN_CHANGE,
    fraction: float = 0.25,
    dry_run: bool = False,
    progress: bool = False,
    to_layered: bool = False,
    layer_chunk_tokens: int = 8,
) -> RelayoutReport:
    """Run the job over `data_dir` (see module docstring). Raises DataDirBusyError if in use.

    With `to_layered`, every importance-layout block is instead migrated to the layered
    layout (per-layer chunks of `layer_chunk_tokens`, key summaries), crash-safe the same way.
    """
    if not 0.0 <= min_change <= 1.0:
        raise ValueError(f"min_change must be in [0, 1], got {min_change}")
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    if not 1 <= layer_chunk_tokens <= 65535:
        raise ValueError(f"layer_chunk_tokens must be in [1, 65535], got {layer_chunk_tokens}")
    if not store_data_file(data_dir).exists():
        raise FileNotFoundError(f"no kvsieve store under {data_dir} (expected {store_data_file(data_dir)})")
    with DataDirLock(data_dir, exclusive=True, purpose="relayout"):
        tier = LmdbTier(store_lmdb_dir(data_dir))
        try:
            if to_layered:
                return _migrate(tier, layer_chunk_tokens, dry_run, progress)
            return _run(tier, min_change, fraction, dry_run, progress)
        finally:
            tier.close()


def _run(tier: LmdbTier, min_change: float, fraction: float, dry_run: bool, progress: bool) -> RelayoutReport:
    report = RelayoutReport(dry_run=dry_run)
    if not dry_run:
        report.stale_chunks_removed = _sweep_stale_chunks(tier)
    metas = list(tier.iter_meta())
    read_before = read_after = wanted = 0
    for meta in progress_bar(metas, progress, "relayout"):
        report.blocks_examined += 1
        if meta.is_layered:
            report.layered_blocks_skipped += 1
            continue
        if meta.scores is None:
            continue
        report.blocks_scored += 1
        top = max(1, budget_to_tokens(fraction, meta.num_tokens))
        wanted += top
        before = chunks_for_top(meta.scores, meta.permutation, fraction, meta.chunk_tokens)
        read_before += before * meta.chunk_tokens
        if layout_change(meta.scores, meta.permutation, fraction) <= min_change:
            read_after += before * meta.chunk_tokens
            continue
        new_perm = importance_order(meta.scores, meta.num_tokens)
        read_after += chunks_for_top(meta.scores, new_perm, fraction, meta.chunk_tokens) * meta.chunk_tokens
        if dry_run:
            report.blocks_rewritten += 1
            continue
        written = _rewrite(tier, meta, new_perm)
        if written is None:
            report.corrupt_blocks_skipped += 1
            continue
        report.blocks_rewritten += 1
        report.bytes_written += written
    if wanted:
        report.read_amp_before = round(read_before / wanted, 4)
        report.read_amp_after = round(read_after / wanted, 4)
    return report


def _read_block_kv(tier: LmdbTier, meta: BlockMeta) -> tuple[np.ndarray, str] | None:
    """An importance-layout block's KV in prompt order and its codec; None if a chunk is
    missing or corrupt (fsck's job)."""
    indices = list(range(meta.num_chunks))
    block_kv = None
    codec = "raw"
    try:
        for index, data in zip(indices, tier.get_chunks(meta, indices), strict=True):
            if data is None:
                return None
            expect = meta.chunk_id(index)
            chunk = decode_chunk(data, expect)
            codec = chunk.codec
            if block_kv is None:
                shape = (*chunk.kv.shape[:3], meta.num_tokens, chunk.kv.shape[4])
                block_kv = np.empty(shape, dtype=chunk.kv.dtype)
            block_kv[:, :, :, meta.chunk_offsets(index)] = chunk.kv
    except ChecksumError:
        return None
    assert block_kv is not None
    return block_kv, codec


def _rewrite(tier: LmdbTier, meta: BlockMeta, new_perm: np.ndarray) -> int | None:
    """Write `meta`'s block in the order `new_perm`; None if its chunks are corrupt (fsck's job)."""
    read = _read_block_kv(tier, meta)
    if read is None:
        return None
    block_kv, codec = read
    indices = list(range(meta.num_chunks))
    version = meta.layout_version + 1
    dtype = block_kv.dtype.name  # "float16" | "bfloat16" (ml_dtypes) | "float32"
    chunks = []
    for index in indices:
        offsets = new_perm[index * meta.chunk_tokens : (index + 1) * meta.chunk_tokens]
        cid = meta.chunk_id(index, version)
        kv = block_kv[:, :, :, offsets]
        chunks.append(encode_chunk(cid, meta.start + offsets, kv, dtype, codec))
    new_meta = meta.with_layout(version, new_perm, sum(len(c) for c in chunks))
    tier.write_layout(meta, new_meta, chunks)
    _fault_point("relayout-between-transactions")
    tier.drop_layout(meta)
    return new_meta.nbytes


def _migrate(tier: LmdbTier, chunk_tokens: int, dry_run: bool, progress: bool) -> RelayoutReport:
    """Rewrite every importance-layout block in the layered layout (module docstring's two steps)."""
    metas = list(tier.iter_meta())
    for meta in metas:  # refuse before anything is written
        if not meta.is_layered and meta.num_tokens % chunk_tokens:
            raise ValueError(
                f"layer_chunk_tokens must divide the blocks' {meta.num_tokens} tokens, got {chunk_tokens}"
            )
    report = RelayoutReport(dry_run=dry_run)
    if not dry_run:
        report.stale_chunks_removed = _sweep_stale_chunks(tier)
    for meta in progress_bar(metas, progress, "relayout --to-layered"):
        report.blocks_examined += 1
        if meta.is_packed:
            report.layered_blocks_skipped += 1
            continue
        reader = _read_layer_records if meta.is_layered else _read_block_kv
        read = None if dry_run else reader(tier, meta)
        if read is None and not dry_run:
            report.corrupt_blocks_skipped += 1
            continue
        if meta.is_layered:  # v2: the same chunks, packed (its own chunk size kept)
            report.blocks_repacked += 1
        else:
            report.blocks_migrated += 1
        if read is not None:
            size = meta.chunk_tokens if meta.is_layered else chunk_tokens
            report.bytes_written += _write_layered(tier, meta, *read, size)
    return report


def _read_layer_records(tier: LmdbTier, meta: BlockMeta) -> tuple[np.ndarray, str] | None:
    """A v2 layered block's KV (layers, 2, kv_heads, tokens, head_dim) from its layer records, and
    their codec; None if one is missing or corrupt (fsck's job)."""
    indices = [meta.record_index(layer, 0) for layer in range(meta.num_layers)]
    layers = []
    codec = "raw"
    try:
        for index, data in zip(indices, tier.get_chunks(meta, indices), strict=True):
            if data is None:
                return None
            header, chunks = decode_layer_record(data, meta.chunk_id(index))
            n, two, heads, c, dim = chunks.shape
            layers.append(chunks.transpose(1, 2, 0, 3, 4).reshape(two, heads, n * c, dim))
            codec = header.codec
    except ChecksumError:
        return None
    return np.stack(layers), codec


def _write_layered(
    tier: LmdbTier, meta: BlockMeta, block_kv: np.ndarray, codec: str, chunk_tokens: int
) -> int:
    version = layered_layout_version(chunk_tokens)  # packed (v3), chunk size in it: what stores write
    new_meta = replace(
        meta, layout=LAYERED, num_layers=block_kv.shape[0], chunk_tokens=chunk_tokens,
        layout_version=version, permutation=np.arange(meta.num_tokens, dtype=np.int64),
    )  # fmt: skip
    records = encode_layered(new_meta, block_kv, block_kv.dtype.name, codec, 1)
    new_meta = replace(new_meta, nbytes=sum(len(r) for r in records))
    tier.write_layout(meta, new_meta, records)
    _fault_point("relayout-between-transactions")
    tier.drop_layout(meta)
    return new_meta.nbytes


FAULT_ENV = "KVSIEVE_FAULT"


def _fault_point(name: str) -> None:
    """Die here by SIGKILL when the test-only fault `name` is armed (module docstring)."""
    if os.environ.get(FAULT_ENV) == name:
        os.kill(os.getpid(), signal.SIGKILL)


def _sweep_stale_chunks(tier: LmdbTier) -> int:
    """Delete chunks of old layouts (left by a job killed between its two transactions)."""
    current = {m.key: m.layout_version for m in tier.iter_meta()}
    keys = [(k, parse_chunk_key(k)) for k in tier.iter_chunk_keys()]
    stale = [k for k, parts in keys if current.get(parts.block_key) != parts.layout_version]
    if stale:
        tier.delete_chunk_keys(stale)
    return len(stale)
