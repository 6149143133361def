"""Leases: pins on blocks that expire by themselves.

A client that dies without unpinning must not keep blocks pinned forever, so every
pin is a lease with a time to live; expired leases are swept on each access. The
table hands out `kvstore.api.Lease` values and keeps its pins to itself: each lease
holds the `radix.tree.Pin` it took, so releasing it touches exactly the nodes it
pinned, never a block dropped and stored again since (a new node under the same key).
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

from kvstore.api import Lease
from kvstore.errors import InvalidInputError, NotFoundError
from radix.tree import Node, Pin


class _Held(NamedTuple):
    lease: Lease
    pin: Pin


class LeaseTable:
    """Creates, renews and expires leases; calls `pin`/`unpin` on the radix tree.

    Args:
        pin: pins exactly the given nodes and returns the pin (`RadixTree.pin`).
        unpin: releases one pin (`RadixTree.unpin`).
        clock: expiry clock (monotonic seconds).
    """

    MAX_TTL_S = 24 * 3600.0

    def __init__(
        self,
        pin: Callable[[Sequence[Node]], Pin],
        unpin: Callable[[Pin], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._pin, self._unpin, self._clock = pin, unpin, clock
        self._leases: dict[str, _Held] = {}
        self._lock = threading.Lock()
        self.expired_total = 0

    def grant(self, nodes: Sequence[Node], ttl_s: float) -> Lease:
        """Pin `nodes` for `ttl_s` seconds. Mutates. InvalidInputError for a bad TTL; KeyError
        (nothing pinned) if a node has left the tree since it was matched."""
        if not 0 < ttl_s <= self.MAX_TTL_S:
            raise InvalidInputError(f"ttl_s must be in (0, {self.MAX_TTL_S:.0f}], got {ttl_s}")
        self.sweep()
        lease = Lease(secrets.token_hex(16), len(nodes), ttl_s, self._clock() + ttl_s)
        with self._lock:
            self._leases[lease.lease_id] = _Held(lease, self._pin(nodes))
        return lease

    def release(self, lease_id: str) -> None:
        """Unpin a lease. Mutates. NotFoundError if unknown or already expired."""
        with self._lock:
            held = self._leases.pop(lease_id, None)
            if held is None:
                raise NotFoundError(f"unknown lease {lease_id!r} (never granted, released or expired)")
            self._unpin(held.pin)

    def keys_of(self, lease_id: str) -> tuple[bytes, ...]:
        """The block keys a live lease pins (empty if it is unknown or gone)."""
        with self._lock:
            held = self._leases.get(lease_id)
            return () if held is None else held.pin.keys

    def sweep(self) -> int:
        """Release expired leases. Mutates. Returns how many expired."""
        now = self._clock()
        with self._lock:
            expired = [lid for lid, held in self._leases.items() if held.lease.expires_at <= now]
            for lid in expired:
                self._unpin(self._leases.pop(lid).pin)
            self.expired_total += len(expired)
        return len(expired)

    def __len__(self) -> int:
        return len(self._leases)
