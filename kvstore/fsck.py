"""Offline consistency check of a data directory: checksums, identities, index links."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from kvstore.codec import ChunkId, decode_chunk
from kvstore.errors import ChecksumError
from kvstore.keys import ROOT_KEY
from kvstore.lock import DataDirLock
from kvstore.meta import BlockMeta
from kvstore.tiers.lmdb import LmdbTier


@dataclass(frozen=True)
class FsckProblem:
    """One finding: which block (hex key), what kind, and details.

    Kinds: bad-metadata, missing-chunk, bad-chunk, size-mismatch, orphan-block, orphan-chunk.
    """

    key: str
    kind: str
    detail: str


@dataclass
class FsckReport:
    """Outcome of `fsck`. `clean` means no problem was found."""

    blocks_checked: int = 0
    chunks_checked: int = 0
    problems: list[FsckProblem] = field(default_factory=list)
    blocks_removed: int = 0
    chunks_removed: int = 0
    repaired: bool = False

    @property
    def clean(self) -> bool:
        """No problem found."""
        return not self.problems

    @property
    def exit_code(self) -> int:
        """0 clean, 1 problems found and repaired, 2 problems left."""
        if self.clean:
            return 0
        return 1 if self.repaired else 2


def fsck(data_dir: str | Path, repair: bool = False, progress: bool = False) -> FsckReport:
    """Verify every chunk and metadata record under `data_dir`; with `repair`, remove bad blocks.

    A bad block takes its descendants with it: they can never be matched without it.
    Must not run while a server writes to the same directory.
    """
    lmdb_dir = Path(data_dir) / "lmdb"
    if not (lmdb_dir / "data.mdb").exists():
        raise FileNotFoundError(f"no kvsieve store under {data_dir} (expected {lmdb_dir}/data.mdb)")
    lock = DataDirLock(data_dir, exclusive=repair, purpose="fsck --repair" if repair else "fsck").acquire()
    tier = LmdbTier(lmdb_dir)
    try:
        report = FsckReport()
        records = list(tier.iter_meta_raw())
        metas = {key: meta for key, meta in records if meta is not None}
        bad = {key for key, meta in records if meta is None}
        report.problems += [FsckProblem(k.hex(), "bad-metadata", "record does not parse") for k in bad]
        for meta in _progress(metas.values(), progress, len(metas)):
            report.blocks_checked += 1
            found = _check_block(tier, meta)
            report.chunks_checked += meta.num_chunks
            report.problems += found
            if found:
                bad.add(meta.key)
        bad |= _orphans(metas, report)
        orphan_chunks = _orphan_chunks(tier, metas)
        report.problems += [
            FsckProblem(k[:16].hex(), "orphan-chunk", "no block refers to it") for k in orphan_chunks
        ]
        if repair and report.problems:
            doomed = _with_descendants(bad, metas)
            for key in doomed:
                tier.delete_raw(key)
            tier.delete_chunk_keys(orphan_chunks)
            report.blocks_removed, report.chunks_removed = len(doomed), len(orphan_chunks)
            report.repaired = True
        return report
    finally:
        tier.close()
        lock.release()


def _check_block(tier: LmdbTier, meta: BlockMeta) -> list[FsckProblem]:
    problems = []
    indices = list(range(meta.num_chunks))
    total = 0
    for index, data in zip(indices, tier.get_chunks(meta, indices), strict=True):
        if data is None:
            problems.append(FsckProblem(meta.key.hex(), "missing-chunk", f"chunk {index} absent"))
            continue
        total += len(data)
        expect = ChunkId(meta.fingerprint, meta.namespace, meta.key, meta.layout_version, index)
        try:
            decode_chunk(data, expect)
        except ChecksumError as exc:
            problems.append(FsckProblem(meta.key.hex(), "bad-chunk", f"chunk {index}: {exc}"))
    if not problems and total != meta.nbytes:
        problems.append(
            FsckProblem(meta.key.hex(), "size-mismatch", f"{total} B stored, {meta.nbytes} B recorded")
        )
    return problems


def _orphans(metas: dict[bytes, BlockMeta], report: FsckReport) -> set[bytes]:
    orphans = set()
    for meta in metas.values():
        if meta.parent != ROOT_KEY and meta.parent not in metas:
            orphans.add(meta.key)
            report.problems.append(FsckProblem(meta.key.hex(), "orphan-block", "parent block is missing"))
    return orphans


def _orphan_chunks(tier: LmdbTier, metas: dict[bytes, BlockMeta]) -> list[bytes]:
    out = []
    for key in tier.iter_chunk_keys():
        meta = metas.get(key[:16])
        if meta is None or int.from_bytes(key[16:20], "big") != meta.layout_version:
            out.append(key)
    return out


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


def _progress(items: Iterable[BlockMeta], enabled: bool, total: int) -> Iterable[BlockMeta]:
    if not enabled:
        return items
    from tqdm import tqdm

    return tqdm(items, total=total, desc="fsck", unit="block")
