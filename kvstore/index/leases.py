"""Leases: pins on blocks that expire by themselves.

A client that dies without unpinning must not keep blocks pinned forever, so every
pin is a lease with a time to live; expired leases are swept on each access. The
table hands out `kvstore.api.Lease` values and keeps the pinned keys to itself.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

from kvstore.api import Lease
from kvstore.errors import InvalidInputError, NotFoundError


class _Held(NamedTuple):
    lease: Lease
    keys: tuple[bytes, ...]


class LeaseTable:
    """Creates, renews and expires leases; calls `pin`/`unpin` on the radix tree."""

    MAX_TTL_S = 24 * 3600.0

    def __init__(
        self,
        pin: Callable[[Sequence[bytes]], None],
        unpin: Callable[[Sequence[bytes]], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._pin, self._unpin, self._clock = pin, unpin, clock
        self._leases: dict[str, _Held] = {}
        self._lock = threading.Lock()
        self.expired_total = 0

    def grant(self, keys: Sequence[bytes], ttl_s: float) -> Lease:
        """Pin `keys` for `ttl_s` seconds. Mutates. InvalidInputError for a bad TTL."""
        if not 0 < ttl_s <= self.MAX_TTL_S:
            raise InvalidInputError(f"ttl_s must be in (0, {self.MAX_TTL_S:.0f}], got {ttl_s}")
        self.sweep()
        held = _Held(Lease(secrets.token_hex(16), len(keys), ttl_s, self._clock() + ttl_s), tuple(keys))
        with self._lock:
            self._pin(held.keys)
            self._leases[held.lease.lease_id] = held
        return held.lease

    def release(self, lease_id: str) -> None:
        """Unpin a lease. Mutates. NotFoundError if unknown or already expired."""
        with self._lock:
            held = self._leases.pop(lease_id, None)
            if held is None:
                raise NotFoundError(f"unknown lease {lease_id!r} (never granted, released or expired)")
            self._unpin(held.keys)

    def keys_of(self, lease_id: str) -> tuple[bytes, ...]:
        """The block keys a live lease pins (empty if it is unknown or gone)."""
        with self._lock:
            held = self._leases.get(lease_id)
            return () if held is None else held.keys

    def sweep(self) -> int:
        """Release expired leases. Mutates. Returns how many expired."""
        now = self._clock()
        with self._lock:
            expired = [lid for lid, held in self._leases.items() if held.lease.expires_at <= now]
            for lid in expired:
                self._unpin(self._leases.pop(lid).keys)
            self.expired_total += len(expired)
        return len(expired)

    def __len__(self) -> int:
        return len(self._leases)
