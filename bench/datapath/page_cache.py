"""Cold page cache for disk benchmarks: drop it as root, else advise the kernel per file."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np


def make_cold(*files: Path, drop_all: bool = True) -> str:
    """Evict `files` from the page cache. Returns the method used ("drop_caches",
    "fadvise") or "none" when neither was possible (the figure is then warm).

    `drop_all=False` evicts only `files` (fadvise): a benchmark whose model weights
    are memory-mapped must not have them dropped too. Files must not be mapped then.
    """
    os.sync()  # only clean pages can be dropped
    if drop_all:
        try:
            with open("/proc/sys/vm/drop_caches", "w") as fh:
                fh.write("3\n")
            return "drop_caches"
        except OSError:
            pass
    try:
        for path in files:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        return "fadvise"
    except OSError:
        return "none"


def cold_seq_read_mb_s(path: Path, nbytes: int, drop_all: bool = True) -> float:
    """MB/s of a cold sequential read of a new file of `nbytes` random bytes at `path`.

    `drop_all=False` evicts only that file, so that a loaded model stays cached.
    """
    write_seq_file(path, nbytes)
    return timed_seq_read_mb_s(path, drop_all=drop_all)


def write_seq_file(path: Path, nbytes: int) -> None:
    """A file of `nbytes` random bytes for `timed_seq_read_mb_s`."""
    path.write_bytes(np.random.default_rng(1).integers(0, 255, nbytes, dtype=np.uint8).tobytes())


def timed_seq_read_mb_s(path: Path, drop_all: bool = True) -> float:
    """MB/s of reading `path` cold, front to back in 4 MiB `read`s into one buffer: the floor
    a disk load is compared with."""
    make_cold(path, drop_all=drop_all)
    buf = bytearray(4 << 20)
    nbytes = 0
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as fh:
        while n := fh.readinto(buf):
            nbytes += n
    return nbytes / (time.perf_counter() - t0) / 1e6
