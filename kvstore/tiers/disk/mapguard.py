"""A shared/exclusive guard around an LMDB map that may be resized.

LMDB's `mdb_env_set_mapsize` may only run while no transaction of the process is
open: it unmaps and remaps the file. A store that grows its map (no disk budget)
did so while other threads (sidecar calls, the readahead thread) had read
transactions open; those loads then failed with `mdb_txn_begin: Invalid argument`
(measured: 1-2 failed loads per 300 growing stores with two loading threads), and a
reader holding a value's address across the remap could read unmapped memory. Read
transactions hold the guard shared; a resize takes it exclusively, waiting for the
open ones to end and holding back new ones meanwhile (a resize is rare and quick,
while a steady stream of readers could otherwise starve it forever).

Read transactions must not nest in one thread: with a resize waiting, the inner one
would wait for the resize, and the resize for the outer one.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class MapGuard:
    """Readers share, a resize excludes; see module docstring. Thread-safe."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._resizing = False
        self._resizes_waiting = 0

    @contextmanager
    def reading(self) -> Iterator[None]:
        """Hold the map in place for one read transaction."""
        with self._cond:
            while self._resizing or self._resizes_waiting:
                self._cond.wait()
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                if not self._readers:
                    self._cond.notify_all()

    @contextmanager
    def resizing(self) -> Iterator[None]:
        """Hold every reader out while the map is resized."""
        with self._cond:
            self._resizes_waiting += 1
            try:
                while self._resizing or self._readers:
                    self._cond.wait()
            finally:
                self._resizes_waiting -= 1
            self._resizing = True
        try:
            yield
        finally:
            with self._cond:
                self._resizing = False
                self._cond.notify_all()
