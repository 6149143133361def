"""Disk write-behind against a sequential write of the same bytes (part of `kvsieve bench transfer`).

Stores prompts into a store whose writer waits (a long `commit_ms`), so that the whole backlog
is in memory; then times `flush`: the group commits alone, encoding excluded (the deferred key
summaries of layered blocks, kvstore/store/deferred.py, are encoded before the clock starts). A sequential
write of the same number of bytes to a file on the same file system, in 8 MiB writes and one
fsync, is the ceiling it is compared with. Alternated, median of each.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvstore.config import StoreConfig
from kvstore.model import ModelSpec
from kvstore.store.tiered import TieredStore

_WRITE_BYTES = 8 << 20


def write_behind_vs_sequential(
    tmp: Path, model: ModelSpec, kv: Any, prompts: int, repeats: int
) -> dict[str, float]:
    """`write_behind_mb_s`, `sequential_write_mb_s` and their ratio, `write_behind_vs_sequential_write`."""
    behind: list[float] = []
    sequential: list[float] = []
    for i in range(repeats):
        nbytes, seconds = _drain(tmp / f"store{i}", model, kv, prompts)
        behind.append(nbytes / seconds)
        sequential.append(nbytes / _sequential_write(tmp / f"seq{i}.bin", nbytes))
    wb, seq = statistics.median(behind), statistics.median(sequential)
    return {
        "write_behind_mb_s": round(wb / 1e6, 1),
        "sequential_write_mb_s": round(seq / 1e6, 1),
        "write_behind_vs_sequential_write": round(wb / seq, 3),
    }


def _drain(data_dir: Path, model: ModelSpec, kv: Any, prompts: int) -> tuple[int, float]:
    """(bytes the backlog held, seconds its group commits took)."""
    config = StoreConfig(data_dir=data_dir, commit_ms=3_600_000, disk_backlog_bytes=1 << 40)
    with TieredStore(config) as store:
        rng = np.random.default_rng(len(str(data_dir)))
        for _ in range(prompts):
            store.store(rng.integers(0, 49152, kv.shape[3]), kv, model=model)
        nbytes = store.stats().get("disk_backlog_bytes")
        store.writer.summaries.finish_all()  # layered blocks' deferred summaries: encoding, not timed
        t0 = time.perf_counter()
        if not store.flush(600):
            raise RuntimeError("the disk backlog did not drain in 600 s")
        return nbytes, time.perf_counter() - t0


def _sequential_write(path: Path, nbytes: int) -> float:
    """Seconds to write `nbytes` to a new file and fsync it."""
    block = np.random.default_rng(0).integers(0, 256, _WRITE_BYTES, dtype=np.uint8).tobytes()
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
    try:
        t0 = time.perf_counter()
        left = nbytes
        while left > 0:
            left -= os.write(fd, block[: min(left, len(block))])
        os.fsync(fd)
        return time.perf_counter() - t0
    finally:
        os.close(fd)
        path.unlink()
