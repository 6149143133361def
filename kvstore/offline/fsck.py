"""Offline consistency check of a data directory: checksums, identities, index links.

fsck never dies with a traceback or a signal. A data file that cannot be mapped
safely (empty, truncated, not LMDB) is reported as unreadable before LMDB touches
it, and `fsck_isolated` (what the CLI runs) does the whole check in a child
process, so that even damage its header does not show (a SIGBUS or SIGSEGV inside
LMDB) becomes an unreadable report instead of a dead `kvsieve fsck`.

Exit codes: 0 clean, 1 every problem found was repaired, 2 problems left or the
store is unreadable, 3 fsck could not run at all (no store at the path, the
directory in use, an internal error).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import signal
from dataclasses import dataclass, field
from pathlib import Path

import lmdb

from kvstore.config import store_data_file, store_lmdb_dir
from kvstore.errors import (
    ChecksumError,
    DamagedStoreError,
    FsckCannotRunError,
    StorageUnavailableError,
)
from kvstore.format.block_meta import BlockMeta
from kvstore.format.chunk import decode_chunk
from kvstore.format.key_summary import decode_summary
from kvstore.format.layer_pack import parse_table, split_pack
from kvstore.format.layer_record import decode_layer_record
from kvstore.keys import ROOT_KEY, parse_chunk_key
from kvstore.offline.progress import progress_bar
from kvstore.tiers.disk.lmdb import LmdbTier
from kvstore.tiers.disk.lock import DataDirLock

EXIT_CLEAN, EXIT_REPAIRED, EXIT_PROBLEMS, EXIT_CANNOT_RUN = 0, 1, 2, 3


@dataclass(frozen=True)
class FsckProblem:
    """One finding: which block (hex key), what kind, and details.

    Kinds: bad-metadata (checksum, parse or key-identity failure), missing-chunk,
    bad-chunk, size-mismatch, orphan-block (parent missing or at the wrong depth),
    orphan-chunk (no block refers to it), stale-chunk (an older layout of a live
    block, left by an interrupted re-layout).
    """

    key: str
    kind: str
    detail: str


@dataclass
class FsckReport:
    """Outcome of `fsck`. `clean` means the store was read and no problem was found.

    `unreadable` says why the store could not be read at all (then nothing was checked).
    `layouts` counts the blocks checked per layout kind ("importance", "layered");
    `chunks_checked` counts records (a layered block's summaries included).
    """

    blocks_checked: int = 0
    chunks_checked: int = 0
    layouts: dict[str, int] = field(default_factory=dict)
    problems: list[FsckProblem] = field(default_factory=list)
    blocks_removed: int = 0
    chunks_removed: int = 0
    repaired: bool = False
    unreadable: str = ""

    @property
    def clean(self) -> bool:
        """Read, and no problem found."""
        return not self.problems and not self.unreadable

    @property
    def exit_code(self) -> int:
        """0 clean, 1 problems found and repaired, 2 problems left or store unreadable."""
        if self.clean:
            return EXIT_CLEAN
        return EXIT_REPAIRED if self.repaired and not self.unreadable else EXIT_PROBLEMS


def fsck(data_dir: str | Path, repair: bool = False, progress: bool = False) -> FsckReport:
    """Verify every chunk and metadata record under `data_dir`; with `repair`, remove bad blocks.

    A bad block takes its descendants with it: they can never be matched without it.
    Must not run while a server writes to the same directory.

    Raises:
        FsckCannotRunError: no store under `data_dir`.
        DataDirBusyError: a server holds the directory (with `repair`) or a job rewrites it.
    """
    lmdb_dir, data_file = store_lmdb_dir(data_dir), store_data_file(data_dir)
    if not data_file.exists():
        raise FsckCannotRunError(f"no kvsieve store under {data_dir} (expected {data_file})")
    purpose = "fsck --repair" if repair else "fsck"
    with DataDirLock(data_dir, exclusive=repair, purpose=purpose):
        try:
            tier = LmdbTier(lmdb_dir)
        except DamagedStoreError as exc:
            return FsckReport(unreadable=exc.reason)
        except StorageUnavailableError as exc:
            return FsckReport(unreadable=str(exc))
        try:
            return _check(tier, repair, progress)
        except lmdb.Error as exc:  # B-tree damage LMDB detects: the store cannot be read
            return FsckReport(unreadable=f"reading {tier.data_file()} failed: {exc}")
        finally:
            tier.close()


def fsck_isolated(data_dir: str | Path, repair: bool = False, progress: bool = False) -> FsckReport:
    """`fsck` in a child process: a signal there becomes an unreadable report, not our death.

    Raises what `fsck` raises (re-raised from the child), or FsckCannotRunError.
    """
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=_child, args=(send, data_dir, repair, progress), daemon=True)
    child.start()
    send.close()
    try:
        outcome = receive.recv() if receive.poll(None) else None
    except EOFError:
        outcome = None
    child.join()
    if isinstance(outcome, FsckReport):
        return outcome
    if isinstance(outcome, BaseException):
        raise outcome
    data_file = store_data_file(data_dir)
    if child.exitcode is not None and child.exitcode < 0:
        name = signal.Signals(-child.exitcode).name
        return FsckReport(unreadable=f"the check died with {name} while reading {data_file}: it is damaged")
    raise FsckCannotRunError(f"the check process exited with code {child.exitcode} and no report")


def _child(
    send: multiprocessing.connection.Connection, data_dir: str | Path, repair: bool, progress: bool
) -> None:
    try:
        send.send(fsck(data_dir, repair, progress))
    except Exception as exc:  # every failure goes back to the parent, typed
        send.send(exc if _picklable(exc) else FsckCannotRunError(f"{type(exc).__name__}: {exc}"))


def _picklable(exc: Exception) -> bool:
    import pickle

    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:  # any pickling failure: send a plain error
        return False
    return True


def _check(tier: LmdbTier, repair: bool, progress: bool) -> FsckReport:
    report = FsckReport()
    records = list(tier.iter_meta_raw())
    metas = {key: meta for key, meta in records if isinstance(meta, BlockMeta)}
    bad = {key for key, meta in records if not isinstance(meta, BlockMeta)}
    report.problems += [FsckProblem(k.hex(), "bad-metadata", m) for k, m in records if isinstance(m, str)]
    for meta in progress_bar(metas.values(), progress, "fsck", len(metas)):
        report.blocks_checked += 1
        report.layouts[meta.layout] = report.layouts.get(meta.layout, 0) + 1
        found = _check_block(tier, meta)
        report.chunks_checked += meta.num_chunks
        report.problems += found
        if found:
            bad.add(meta.key)
    bad |= _orphans(metas, report)
    orphan_chunks, stale_chunks = _stray_chunks(tier, metas, skip=bad)
    for parts in map(parse_chunk_key, orphan_chunks):
        report.problems.append(FsckProblem(parts.block_key.hex(), "orphan-chunk", "no block refers to it"))
    for parts in map(parse_chunk_key, stale_chunks):
        detail = f"layout {parts.layout_version} is not current"
        report.problems.append(FsckProblem(parts.block_key.hex(), "stale-chunk", detail))
    if repair and report.problems:
        doomed = _with_descendants(bad, metas)
        for key in doomed:
            tier.delete_raw(key)
        tier.delete_chunk_keys(orphan_chunks + stale_chunks)
        report.blocks_removed, report.chunks_removed = len(doomed), len(orphan_chunks) + len(stale_chunks)
        report.repaired = True
    return report


def _check_block(tier: LmdbTier, meta: BlockMeta) -> list[FsckProblem]:
    problems = []
    indices = list(range(meta.num_chunks))
    total = 0
    for index, data in zip(indices, tier.get_chunks(meta, indices), strict=True):
        if data is None:
            problems.append(FsckProblem(meta.key.hex(), "missing-chunk", f"chunk {index} absent"))
            continue
        total += len(data)
        expect = meta.chunk_id(index)
        summary = meta.is_layered and index < meta.num_layers  # kvstore/load/read_layered.py
        layer_record = meta.is_layered and not summary
        try:
            if summary:
                decode_summary(data, expect)
            elif meta.is_packed:  # the pack's table, then every record in it as below
                for layer, part in enumerate(split_pack(data, parse_table(data, expect, meta.num_layers))):
                    decode_layer_record(part, meta.chunk_id(meta.num_layers + layer))
            elif layer_record:  # header and every chunk's checksum
                decode_layer_record(data, expect)
            else:
                decode_chunk(data, expect)
        except ChecksumError as exc:
            what = f"summary {index} (layer {index})" if summary else f"chunk {index}"
            if layer_record:
                what = (
                    f"layer pack {index}"
                    if meta.is_packed
                    else f"layer record {index} (layer {index - meta.num_layers})"
                )
            problems.append(FsckProblem(meta.key.hex(), "bad-chunk", f"{what}: {exc}"))
    if not problems and total != meta.nbytes:
        problems.append(
            FsckProblem(meta.key.hex(), "size-mismatch", f"{total} B stored, {meta.nbytes} B recorded")
        )
    return problems


def _orphans(metas: dict[bytes, BlockMeta], report: FsckReport) -> set[bytes]:
    orphans = set()
    for meta in metas.values():
        if meta.parent == ROOT_KEY:
            continue
        parent = metas.get(meta.parent)
        if parent is None:
            detail = "parent block is missing"
        elif parent.depth != meta.depth - 1:
            detail = f"depth {meta.depth} under a parent at depth {parent.depth}"
        else:
            continue
        orphans.add(meta.key)
        report.problems.append(FsckProblem(meta.key.hex(), "orphan-block", detail))
    return orphans


def _stray_chunks(
    tier: LmdbTier, metas: dict[bytes, BlockMeta], skip: set[bytes]
) -> tuple[list[bytes], list[bytes]]:
    """(chunks of no block, chunks of a live block's older layout); blocks in `skip` excluded."""
    orphans, stale = [], []
    for key in tier.iter_chunk_keys():
        parts = parse_chunk_key(key)
        if parts.block_key in skip:
            continue  # a bad block's chunks go with it
        meta = metas.get(parts.block_key)
        if meta is None:
            orphans.append(key)
        elif parts.layout_version != meta.layout_version:
            stale.append(key)
    return orphans, stale


def _with_descendants(keys: set[bytes], metas: dict[bytes, BlockMeta]) -> set[bytes]:
    doomed = set(keys)
    changed = True
    while changed:
        changed = False
        for meta in metas.values():
            if meta.key not in doomed and meta.parent in doomed:
                doomed.add(meta.key)
                changed = True
    return doomed
