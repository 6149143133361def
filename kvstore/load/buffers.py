"""glibc malloc tuning for processes that move large buffers.

Chunks are 0.1-6 MB. glibc serves allocations above its mmap threshold with
fresh mmap()s, whose pages fault in one by one on first touch, and returns them
on free: every chunk then pays page faults again. Measured here, copying 47 MB
into fresh memory took 150 ms against 6.5 ms into reused memory. Raising the
mmap and trim thresholds keeps freed chunk buffers in the heap for reuse, which
is what jemalloc/tcmalloc deployments get by default.
"""

from __future__ import annotations

import ctypes
import ctypes.util

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def keep_large_buffers(mmap_threshold_bytes: int = 256 << 20, trim_threshold_bytes: int = 1 << 30) -> bool:
    """Raise glibc's mmap and trim thresholds in this process. False where not glibc."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        ok_mmap = libc.mallopt(_M_MMAP_THRESHOLD, mmap_threshold_bytes)
        ok_trim = libc.mallopt(_M_TRIM_THRESHOLD, trim_threshold_bytes)
    except (OSError, AttributeError):
        return False
    return bool(ok_mmap and ok_trim)
