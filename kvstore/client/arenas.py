"""The client's shared-memory arenas: server memory mapped here, lent to one load at a time.

A co-located `KVClient` asks the server for an arena (a sealed memfd), maps it,
and names it in each Load; the server writes the chunks' KV there and sends only
their slots, so a load costs no copy on either side. A Store goes the other way:
the client writes the KV into an arena and the server encodes it from there (its one copy).
"""

from __future__ import annotations

import contextlib
import mmap
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

Array = np.ndarray[Any, Any]


@dataclass
class ClientArena:
    """A server arena mapped here, lent to one load or store at a time.

    `writable`: mapped read-write, because the server takes Stores through it.
    """

    arena_id: str
    namespace: str
    buf: mmap.mmap
    writable: bool = False

    def unmap(self) -> None:
        """Unmap, unless numpy views still use it (then the GC unmaps later)."""
        with contextlib.suppress(BufferError):
            self.buf.close()


class ArenaPool:
    """The client's shared-memory arenas, per namespace: reused so their pages stay warm.

    An arena is lent to one load at a time and comes back only when the caller
    closes the stream (after which its chunk views must not be used). A load that
    needs more room than the free arenas have gets a new arena sized to it, and
    the smaller ones are released. A stream dropped without `close` leaves its
    arena to the caller's views and asks the server to unmap it at the next call.

    Args:
        create: makes and maps a new arena (namespace, nbytes), or returns None.
    """

    KEEP_FREE = 4
    MIN_BYTES = 1 << 20

    def __init__(self, create: Callable[[str, int], ClientArena | None]) -> None:
        self._create = create
        self._free: list[ClientArena] = []
        self._orphans: list[tuple[str, str]] = []
        self._lock = threading.Lock()

    def take(self, namespace: str, nbytes: int) -> ClientArena | None:
        """A free arena of `namespace` with at least `nbytes`, or a new one (None if shm fails)."""
        with self._lock:
            mine = [a for a in self._free if a.namespace == namespace]
            for arena in mine:
                if len(arena.buf) >= nbytes:
                    self._free.remove(arena)
                    return arena
            for arena in mine:  # too small for this load: grow by replacing them
                self._free.remove(arena)
                self._orphans.append((arena.arena_id, arena.namespace))
                arena.unmap()
        size = -(-max(nbytes, self.MIN_BYTES) // self.MIN_BYTES) * self.MIN_BYTES
        return self._create(namespace, size)

    def give(self, arena: ClientArena) -> None:
        """Return an arena after its stream was closed."""
        with self._lock:
            if len(self._free) < self.KEEP_FREE:
                self._free.append(arena)
                return
            self._orphans.append((arena.arena_id, arena.namespace))
        arena.unmap()

    def discard(self, arena: ClientArena) -> None:
        """Give up an arena (the server did not use it, or the call failed); the server unmaps it."""
        self.orphan(arena.arena_id, arena.namespace)
        arena.unmap()

    def orphan(self, arena_id: str, namespace: str) -> None:
        """An arena the server should unmap (e.g. its stream was garbage-collected unclosed)."""
        with self._lock:
            self._orphans.append((arena_id, namespace))

    def take_orphans(self) -> list[tuple[str, str]]:
        """(arena id, namespace) pairs to release on the server."""
        with self._lock:
            orphans, self._orphans = self._orphans, []
        return orphans

    def drain(self) -> list[ClientArena]:
        """Every free arena, removed from the pool and unmapped."""
        with self._lock:
            free, self._free = self._free, []
        for arena in free:
            arena.unmap()
        return free


def increasing(positions: Array) -> bool:
    """Whether positions strictly increase."""
    return bool(np.all(positions[1:] > positions[:-1]))


def gather_by_position(dense: Array, positions: Array) -> tuple[Array, Array]:
    """(sorted positions, their KV) from an arena written by position: a view of its first
    slots when the positions are 0..n-1, else one gathering copy, in position order."""
    positions = np.sort(positions)
    if len(positions) and positions[-1] == len(positions) - 1 and increasing(positions):
        return positions, dense[:, :, :, : len(positions)]
    return positions, np.take(dense, positions, axis=3)
