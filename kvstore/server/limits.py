"""What one request and one tenant may take from the sidecar: bytes in flight, pins, stored bytes.

Every limit is checked before the work it bounds (before an allocation, before a
pin is kept), and a refusal names the ServerConfig field that sets it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from kvstore.api import Lease
from kvstore.errors import InvalidInputError, LimitExceededError


class ByteBudget:
    """Bytes reserved by requests in flight, up to `limit` in total (thread-safe)."""

    def __init__(self, limit: int, field_name: str) -> None:
        self._limit, self._field = limit, field_name
        self._used = 0
        self._lock = threading.Lock()

    @contextmanager
    def reserve(self, nbytes: int) -> Iterator[None]:
        """Hold `nbytes` for the duration of the block. LimitExceededError if they are not free."""
        with self._lock:
            if self._used + nbytes > self._limit:
                raise LimitExceededError(
                    f"{nbytes} B would bring requests in flight to {self._used + nbytes} B, above "
                    f"{self._field}={self._limit}; retry later"
                )
            self._used += nbytes
        try:
            yield
        finally:
            with self._lock:
                self._used -= nbytes

    @property
    def used(self) -> int:
        """Bytes reserved now."""
        return self._used


def check_token_count(num_tokens: int, limit: int, field_name: str) -> int:
    """`num_tokens`, or InvalidInputError naming the limit it exceeds."""
    if num_tokens > limit:
        raise InvalidInputError(f"tokens: {num_tokens} exceeds {field_name} {limit}")
    return num_tokens


def tokens_array(tokens: Any, limit: int, field_name: str) -> np.ndarray[Any, Any]:
    """Repeated uint32 -> uint32 array, refusing more than `limit` tokens before converting.

    Converts in slices so that, in a worker thread, a huge request yields the GIL
    between slices instead of holding it for the whole conversion.
    """
    n = check_token_count(len(tokens), limit, field_name)
    out = np.empty(n, np.uint32)
    step = 1 << 16
    for start in range(0, n, step):
        out[start : start + step] = tokens[start : start + step]
    return out


def token_count(request: Any) -> int:
    """How many tokens a Lookup or Load request carries (packed or repeated)."""
    packed = len(request.tokens_u32le)
    return packed // 4 if packed else len(request.tokens)


def request_tokens(request: Any, limit: int, field_name: str) -> np.ndarray[Any, Any]:
    """A Lookup or Load request's tokens: the packed `tokens_u32le` when set (no per-token
    conversion), else the repeated `tokens`; more than `limit` is refused before converting."""
    packed = request.tokens_u32le
    if not packed:
        return tokens_array(request.tokens, limit, field_name)
    if len(packed) % 4:
        raise InvalidInputError(f"tokens_u32le: {len(packed)} bytes is not a whole number of u32 tokens")
    check_token_count(len(packed) // 4, limit, field_name)
    return np.frombuffer(packed, "<u4").astype(np.uint32, copy=False)


class _Pinned(NamedTuple):
    lease: Lease
    keys: tuple[bytes, ...]


@dataclass
class _Pins:
    leases: dict[str, _Pinned] = field(default_factory=dict)


class TenantLeases:
    """Which namespace holds each lease, and per-namespace caps on leases and pinned bytes.

    Expired leases are pruned on every call, so the map never outgrows the live
    leases. Thread-safe.

    Args:
        max_leases: live leases one namespace may hold.
        max_pinned_bytes: bytes of distinct blocks one namespace may keep pinned (None: no cap).
        block_bytes: nbytes of a block key (0 if it is gone).
        clock: the clock of the store's lease table (monotonic seconds).
    """

    def __init__(
        self,
        max_leases: int,
        max_pinned_bytes: int | None,
        block_bytes: Callable[[bytes], int],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._max_leases, self._max_bytes = max_leases, max_pinned_bytes
        self._block_bytes, self._clock = block_bytes, clock
        self._by_namespace: dict[str, _Pins] = {}
        self._namespace_of: dict[str, str] = {}
        self._lock = threading.Lock()

    def admit(self, namespace: str, lease: Lease, keys: Sequence[bytes]) -> None:
        """Record a granted lease pinning `keys`, or raise LimitExceededError (the caller then unpins it)."""
        with self._lock:
            self._prune()
            pins = self._by_namespace.setdefault(namespace, _Pins())
            if len(pins.leases) >= self._max_leases:
                raise LimitExceededError(
                    f"namespace {namespace!r} holds {len(pins.leases)} leases, the most "
                    f"namespace_max_leases allows; unpin some or let them expire"
                )
            if self._max_bytes is not None:
                distinct = {k for held in pins.leases.values() for k in held.keys} | set(keys)
                pinned = sum(self._block_bytes(k) for k in distinct)
                if pinned > self._max_bytes:
                    raise LimitExceededError(
                        f"namespace {namespace!r} would pin {pinned} B, above its quota of "
                        f"{self._max_bytes} B (namespace_pinned_fraction of the store budget)"
                    )
            pins.leases[lease.lease_id] = _Pinned(lease, tuple(keys))
            self._namespace_of[lease.lease_id] = namespace

    def namespace_of(self, lease_id: str) -> str | None:
        """The namespace of a live lease, or None."""
        with self._lock:
            self._prune()
            return self._namespace_of.get(lease_id)

    def forget(self, lease_id: str) -> None:
        """A lease was released."""
        with self._lock:
            namespace = self._namespace_of.pop(lease_id, None)
            if namespace is not None:
                self._by_namespace[namespace].leases.pop(lease_id, None)

    def count(self, namespaces: frozenset[str] | None) -> int:
        """Live leases of `namespaces` (None: all)."""
        with self._lock:
            self._prune()
            held = self._by_namespace.items()
            return sum(len(p.leases) for ns, p in held if namespaces is None or ns in namespaces)

    def __len__(self) -> int:
        return len(self._namespace_of)

    def _prune(self) -> None:
        now = self._clock()
        for namespace, pins in list(self._by_namespace.items()):
            for lease_id in [lid for lid, held in pins.leases.items() if held.lease.expires_at <= now]:
                del pins.leases[lease_id]
                self._namespace_of.pop(lease_id, None)
            if not pins.leases:
                del self._by_namespace[namespace]
