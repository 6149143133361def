"""POSIX shared memory for the zero-copy load path of a co-located client.

The client creates the segment and names it in its Load request; the server maps
it, writes chunk KV into it and streams only (offset, length) descriptors; the
client reads the KV in place. Both sides unlink the name as soon as both have
it mapped (the server right after opening, the client when the stream's header
arrives), so no segment outlives its users even if either side is killed: the
kernel frees the memory when the last mapping goes away.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import secrets
from pathlib import Path
from typing import Any

import numpy as np

from kvstore.errors import InvalidInputError
from kvstore.model import ModelSpec

SHM_DIR = Path("/dev/shm")
_NAME = re.compile(r"^kvsieve-[0-9]+-[0-9a-f]{16}$")


def available() -> bool:
    """Whether POSIX shared memory is usable here (Linux /dev/shm)."""
    return SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK)


class Segment:
    """A mapped shared-memory segment. `buf` stays valid after `unlink`."""

    def __init__(self, name: str, buf: mmap.mmap) -> None:
        self.name = name
        self.buf = buf

    @classmethod
    def create(cls, nbytes: int) -> Segment:
        """Create and map a new segment of `nbytes` (pages are allocated on first write)."""
        name = f"kvsieve-{os.getpid()}-{secrets.token_hex(8)}"
        fd = os.open(SHM_DIR / name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, max(nbytes, 1))
            return cls(name, mmap.mmap(fd, max(nbytes, 1)))
        finally:
            os.close(fd)

    @classmethod
    def open(cls, name: str, min_bytes: int) -> Segment:
        """Map a segment a client created. InvalidInputError for a bad name or size."""
        if not _NAME.match(name):
            raise InvalidInputError(f"shm_name {name!r} is not a kvsieve segment name")
        fd = os.open(SHM_DIR / name, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            if size < min_bytes:
                raise InvalidInputError(f"shm segment {name} has {size} bytes, needs {min_bytes}")
            return cls(name, mmap.mmap(fd, size))
        finally:
            os.close(fd)

    def unlink(self) -> None:
        """Remove the name (idempotent); existing mappings stay valid."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(SHM_DIR / self.name)

    def close(self) -> None:
        """Unmap, unless numpy views still use the buffer (then the GC unmaps later)."""
        with contextlib.suppress(BufferError):
            self.buf.close()


def dense_view(buf: mmap.mmap, model: ModelSpec) -> np.ndarray[Any, Any]:
    """The arena as a KV array (layers, 2, kv_heads, capacity tokens, head_dim)."""
    capacity = len(buf) // model.token_bytes
    flat = np.frombuffer(buf, model.np_dtype, capacity * model.token_bytes // model.itemsize)
    return flat.reshape(model.kv_shape(capacity))


def leaked_segments() -> list[str]:
    """Names of kvsieve segments present in /dev/shm (for tests and `kvsieve stats`)."""
    if not SHM_DIR.is_dir():
        return []
    return sorted(p.name for p in SHM_DIR.iterdir() if p.name.startswith("kvsieve-"))
