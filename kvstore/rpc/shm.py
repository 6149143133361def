"""Shared memory for the zero-copy load path of a co-located client.

The server creates every arena, never the client, so that no client can make the
server write anywhere but memory made for it:

- An arena is an anonymous `memfd`: it has no name in /dev/shm that a client
  could replace by a symlink, pre-create, or leave behind.
- Its pages are reserved with `posix_fallocate` when it is made, so a small
  memory limit fails there, cleanly (the load then goes inline), and never later
  as SIGBUS while the server writes.
- It is sealed with F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL: nobody, not even a
  process that opens it read-write, can truncate it under the server's mapping.
- The client maps it through /proc/<server_pid>/fd/<fd> (the kernel allows that
  only to a process of the server's uid) and checks its inode, size and seals
  before use; read-write only where the server takes Stores through it, and the
  server copies a Store's KV out before reading it (the client could change it
  at any time, as any process of the same uid could).

The memory is freed when the server closes its fd and the client unmaps.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvstore.errors import InvalidInputError
from kvstore.model import ModelSpec

SHM_DIR = Path("/dev/shm")
ARENA_NAME = "kvsieve-arena"  # shown as "/memfd:kvsieve-arena" in /proc/<pid>/fd
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def available() -> bool:
    """Whether this host can share arenas (Linux memfd and /proc)."""
    return hasattr(os, "memfd_create") and Path("/proc/self/fd").is_dir()


@dataclass(frozen=True)
class ArenaRef:
    """Where a client finds a server arena: /proc/<pid>/fd/<fd>, `nbytes`, `inode`."""

    pid: int
    fd: int
    nbytes: int
    inode: int

    @property
    def path(self) -> str:
        """The magic link a client opens."""
        return f"/proc/{self.pid}/fd/{self.fd}"


class ServerArena:
    """A sealed, fully reserved memfd mapped read-write by the server."""

    def __init__(self, fd: int, buf: mmap.mmap) -> None:
        self.fd = fd
        self.buf = buf

    @classmethod
    def create(cls, nbytes: int) -> ServerArena:
        """Make an arena of exactly `nbytes`. OSError (ENOMEM, ENOSPC) if the memory is not there."""
        if nbytes < 1:
            raise InvalidInputError(f"arena nbytes must be >= 1, got {nbytes}")
        fd = os.memfd_create(ARENA_NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, nbytes)
            os.posix_fallocate(fd, 0, nbytes)  # every page exists now: no SIGBUS on write later
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
            return cls(fd, mmap.mmap(fd, nbytes))
        except BaseException:
            os.close(fd)
            raise

    def ref(self) -> ArenaRef:
        """How a co-located client of the same uid maps this arena."""
        st = os.fstat(self.fd)
        return ArenaRef(os.getpid(), self.fd, st.st_size, st.st_ino)

    def close(self) -> None:
        """Unmap (unless numpy views still use the buffer) and close the fd. Idempotent."""
        with contextlib.suppress(BufferError, ValueError):
            self.buf.close()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def map_arena(ref: ArenaRef, writable: bool = False) -> mmap.mmap:
    """Map a server arena (read-only unless `writable`). OSError if it is not reachable or
    not the expected one.

    Fails on another host, in another pid namespace, under another uid, or when
    the fd number now names something else (inode, size and seals are checked).
    Writable is for Stores: the server copies a Store's KV out of the arena before
    it reads it, so what the client writes there later cannot change what is stored.
    """
    fd = os.open(ref.path, (os.O_RDWR if writable else os.O_RDONLY) | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        if (st.st_ino, st.st_size) != (ref.inode, ref.nbytes) or seals & _SEALS != _SEALS:
            raise OSError(f"{ref.path} is not the sealed arena of {ref.nbytes} B the server named")
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        return mmap.mmap(fd, ref.nbytes, prot=prot)
    finally:
        os.close(fd)


def dense_view(buf: Any, model: ModelSpec) -> np.ndarray[Any, Any]:
    """The arena as a KV array (layers, 2, kv_heads, capacity tokens, head_dim)."""
    capacity = len(buf) // model.token_bytes
    flat = np.frombuffer(buf, model.np_dtype, capacity * model.token_bytes // model.itemsize)
    return flat.reshape(model.kv_shape(capacity))


def leaked_segments() -> list[str]:
    """Names of kvsieve segments present in /dev/shm (none should ever exist now)."""
    if not SHM_DIR.is_dir():
        return []
    return sorted(p.name for p in SHM_DIR.iterdir() if p.name.startswith("kvsieve-"))


def open_arenas(pid: int) -> list[int]:
    """Inodes of the kvsieve arenas that process `pid` holds open (for tests and checks).

    Inodes, not fds: Python's mmap keeps a duplicate fd of what it maps, so the
    server holds two fds per arena.
    """
    inodes = set()
    with contextlib.suppress(FileNotFoundError, PermissionError):
        for entry in os.scandir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                if os.readlink(entry.path).startswith(f"/memfd:{ARENA_NAME}"):
                    inodes.add(os.stat(entry.path).st_ino)
    return sorted(inodes)


def process_alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie counts as exited)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] not in ("Z", "X")
