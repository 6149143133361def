"""A warm page cache for benchmarks that promise one, and a check that it stayed warm.

A benchmark of loads "from the page cache" measures disk reads instead when something
drops the cache meanwhile: on a machine shared with other jobs, a cold-read benchmark's
`drop_caches` (bench/datapath/page_cache.py) empties it for every process. Measured here
(issue 47 item 4): 134 drops in two hours, and a `kvsieve bench vllm` whose hits after a
restart read a third of their blocks from the disk. So such a benchmark reads its files
right before the measured part, and reports the drops that happened during it.
"""

from __future__ import annotations

from pathlib import Path

_VMSTAT = Path("/proc/vmstat")


def warm_files(*paths: Path) -> int:
    """Read every file whole (the page cache then holds it); the bytes read."""
    buf = bytearray(8 << 20)
    nbytes = 0
    for path in paths:
        with open(path, "rb", buffering=0) as fh:
            while n := fh.readinto(buf):
                nbytes += n
    return nbytes


def cache_drops() -> int:
    """How many times the page cache was dropped machine-wide since boot (`drop_pagecache` of
    /proc/vmstat); 0 where the kernel does not say."""
    try:
        for line in _VMSTAT.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == "drop_pagecache":
                return int(value)
    except OSError:
        pass
    return 0
