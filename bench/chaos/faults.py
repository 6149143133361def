"""Faults for `kvsieve bench chaos`: bytes flipped in a stopped store's LMDB file, a small
tmpfs to fill, and a client process to kill while it stores and loads through shared memory.

Flips go into record *values* only (found in the file by their bytes), never into
LMDB's own page structure: what is tested is whether kvsieve trusts a damaged
record, not whether LMDB survives a damaged B-tree.
"""

from __future__ import annotations

import contextlib
import random
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvstore.config import LMDB_DATA_FILE
from kvstore.model import ModelSpec

MODEL = ModelSpec("chaos-tiny", num_layers=2, num_kv_heads=2, head_dim=16)
BLOCK_TOKENS = 32
CLIENT_SEED_BASE = 1_000_000  # child clients' prefixes never share a first token with the parent's


@dataclass(frozen=True)
class Prefix:
    """A prompt and the KV stored for it: the ground truth every load is checked against."""

    tokens: np.ndarray[Any, Any]
    kv: np.ndarray[Any, Any]


def make_prefix(seed: int, blocks: int) -> Prefix:
    """Deterministic tokens and KV; the first token is the seed, so prefixes never share a block."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 50_000, blocks * BLOCK_TOKENS).astype(np.uint32)
    tokens[0] = seed
    kv = rng.standard_normal(MODEL.kv_shape(len(tokens))).astype(MODEL.np_dtype)
    return Prefix(tokens, kv)


@dataclass(frozen=True)
class MetaFlip:
    """A token id flipped inside a block's metadata: the prompt that now names that block."""

    mutant: np.ndarray[Any, Any]


def _records(lmdb_dir: Path, db_name: bytes) -> list[bytes]:
    import lmdb

    env = lmdb.open(str(lmdb_dir), readonly=True, lock=False, max_dbs=4)
    try:
        db = env.open_db(db_name, create=False)
        with env.begin(db=db) as txn:
            return [bytes(value) for _key, value in txn.cursor()]
    finally:
        env.close()


def _flip_in_file(path: Path, record: bytes, offset: int, bit: int) -> int:
    """Flip `bit` of byte `offset` of every copy of `record` in the file; returns copies flipped."""
    data = bytearray(path.read_bytes())
    copies, start = 0, data.find(record)
    while start >= 0:
        data[start + offset] ^= 1 << bit
        copies += 1
        start = data.find(record, start + len(record))
    if copies:
        path.write_bytes(bytes(data))
    return copies


def chunk_records(lmdb_dir: Path) -> list[bytes]:
    """Every value of the chunk database: chunk records, and the layered layout's layer
    records and key summaries."""
    return _records(lmdb_dir, b"chunks")


def flip_record(lmdb_dir: Path, record: bytes, rng: random.Random) -> bool:
    """Flip one random bit of `record` where it lies in the file. False if it was not found."""
    return _flip_in_file(lmdb_dir / LMDB_DATA_FILE, record, rng.randrange(len(record)), rng.randrange(8)) > 0


def flip_chunk_byte(lmdb_dir: Path, rng: random.Random) -> bool:
    """Flip one random bit of one random chunk record. False if no chunk was found in the file."""
    chunks = chunk_records(lmdb_dir)
    return bool(chunks) and flip_record(lmdb_dir, rng.choice(chunks), rng)


def flip_meta_token(lmdb_dir: Path, prefixes: list[Prefix], rng: random.Random) -> MetaFlip | None:
    """Flip the low bit of one token id inside the metadata record of one of `prefixes`' blocks."""
    blocks: dict[bytes, tuple[Prefix, int]] = {}
    for prefix in prefixes:
        for start in range(0, len(prefix.tokens), BLOCK_TOKENS):
            block = prefix.tokens[start : start + BLOCK_TOKENS].astype("<u4").tobytes()
            blocks[block] = (prefix, start)
    found = []
    for record in _records(lmdb_dir, b"blocks"):
        for block, (prefix, start) in blocks.items():
            at = record.find(block)
            if at >= 0:
                found.append((record, at, prefix, start))
                break
    if not found:
        return None
    record, at, prefix, start = rng.choice(found)
    index = rng.randrange(BLOCK_TOKENS)
    if not _flip_in_file(lmdb_dir / LMDB_DATA_FILE, record, at + 4 * index, 0):
        return None
    mutant = prefix.tokens.copy()
    mutant[start + index] ^= 1
    return MetaFlip(mutant)


def flip_meta_byte(lmdb_dir: Path, rng: random.Random) -> bool:
    """Flip one random bit anywhere in one block metadata record (header, key, tokens, layout)."""
    records = _records(lmdb_dir, b"blocks")
    if not records:
        return False
    record = rng.choice(records)
    return _flip_in_file(lmdb_dir / LMDB_DATA_FILE, record, rng.randrange(len(record)), rng.randrange(8)) > 0


@contextlib.contextmanager
def small_tmpfs(path: Path, size_bytes: int) -> Iterator[str]:
    """Mount a tmpfs of `size_bytes` at `path`; yields "" or, if it cannot be mounted, why not."""
    path.mkdir(parents=True, exist_ok=True)
    mount = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    if mount.returncode != 0:
        yield f"mount -t tmpfs failed: {mount.stderr.strip() or mount.returncode}"
        return
    try:
        yield ""
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def start_client(address: str, seed: int) -> subprocess.Popen[str]:
    """A client process storing and loading (shared memory) in a loop until killed."""
    cmd = [sys.executable, "-m", __name__, address, str(seed)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)


def _client_loop(address: str, seed: int) -> None:
    from kvstore.client.kvclient import KVClient

    with KVClient(address, use_shm=True, timeout_s=10) as client:
        print("ready", flush=True)
        for step in range(10**9):
            prefix = make_prefix(CLIENT_SEED_BASE + seed * 1000 + step % 50, 2)
            with contextlib.suppress(Exception):  # the server may be down: keep going until killed
                client.store(prefix.tokens, prefix.kv, model=MODEL)
                client.load_arrays(prefix.tokens, model=MODEL)


if __name__ == "__main__":
    _client_loop(sys.argv[1], int(sys.argv[2]))
