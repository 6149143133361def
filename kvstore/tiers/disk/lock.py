"""An advisory lock on a data directory: shared by stores, exclusive for offline jobs.

`kvsieve relayout` and `kvsieve fsck --repair` rewrite LMDB behind the index of
any running store, so they take the lock exclusively and refuse to start while a
server (or any embedded store) holds it. flock is released by the kernel when a
process dies, so a crashed server never leaves a stale lock behind.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from kvstore.errors import DataDirBusyError

LOCK_NAME = "kvsieve.lock"


class DataDirLock:
    """flock on DATA_DIR/kvsieve.lock. Use as a context manager or call acquire/release."""

    def __init__(self, data_dir: str | os.PathLike[str], exclusive: bool, purpose: str) -> None:
        self._path = Path(data_dir) / LOCK_NAME
        self._exclusive = exclusive
        self._purpose = purpose
        self._fd: int | None = None

    def acquire(self) -> DataDirLock:
        """Take the lock without waiting. Raises DataDirBusyError naming the conflict."""
        self._path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self._path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, (fcntl.LOCK_EX if self._exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            if self._exclusive:
                raise DataDirBusyError(
                    f"{self._path.parent} is in use by a running kvsieve server or store; "
                    f"stop it before {self._purpose}"
                ) from None
            raise DataDirBusyError(
                f"{self._path.parent} is being rewritten by an offline job (relayout or fsck --repair); "
                f"wait for it to finish before {self._purpose}"
            ) from None
        self._fd = fd
        return self

    def release(self) -> None:
        """Drop the lock. Idempotent."""
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> DataDirLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
