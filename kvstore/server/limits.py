"""What one request and one tenant may take from the sidecar: streams, bytes in flight, pins,
stored bytes, and time.

Every limit is checked before the work it bounds (before an allocation, before a
pin is kept), and a refusal names the ServerConfig field that sets it. Every
reservation that a server-wide figure sums (stream slots, bytes in flight, pins) is
also capped per tenant, so one tenant's abuse exhausts only its own share: it gets
RESOURCE_EXHAUSTED, nobody else does. A tenant is the caller's bearer token when
auth is on, else the namespace it names (`Tenant`).
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar

import numpy as np

from kvstore.api import Lease
from kvstore.errors import InvalidInputError, LimitExceededError

T = TypeVar("T")


class Tenant(NamedTuple):
    """Who a reservation is counted against: `key` in the books, `label` in refusals
    (never the token itself)."""

    key: str
    label: str


def tenant_of(token: str | None, namespace: str) -> Tenant:
    """The bearer token when auth is on (one tenant, whatever namespaces it names), else the namespace."""
    if token is not None:
        return Tenant(f"token:{token}", "this bearer token")
    return Tenant(f"namespace:{namespace}", f"namespace {namespace!r}")


async def within(
    step: Awaitable[T],
    idle_s: float,
    refusal: str,
    *,
    gone: Callable[[], bool] | None = None,
    poll_s: float = 0.25,
) -> T:
    """`step`'s result, or LimitExceededError(`refusal`) when the client made it wait `idle_s`
    seconds (a request that does not come, an answer it does not take).

    Not `asyncio.wait_for`: cancelled (the client went away), wait_for waits until the step
    itself ends, and a gRPC write blocked on flow control ends only when the call does, so
    the handler (and the pin or arena it holds) would outlive the client. `asyncio.wait`
    returns at once; the abandoned step is cancelled and left to end with the call.

    A write blocked on flow control does not always learn that the client died either, so
    with `gone` (grpc's `context.done`) the call's state is polled every `poll_s` seconds,
    and the step ends (CancelledError) as soon as the call is over.
    """
    task = asyncio.ensure_future(step)
    deadline = asyncio.get_running_loop().time() + idle_s
    try:
        while True:
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                raise LimitExceededError(refusal)
            done, _ = await asyncio.wait({task}, timeout=left if gone is None else min(left, poll_s))
            if done:
                return task.result()
            if gone is not None and gone():
                raise asyncio.CancelledError("the call ended while an answer waited to be sent")
    finally:
        if not task.done():
            task.cancel()


class ByteBudget:
    """Bytes reserved by requests in flight, up to `limit` in total and `tenant_limit` per
    tenant (thread-safe)."""

    def __init__(
        self, limit: int, field_name: str, tenant_limit: int | None = None, tenant_field: str = ""
    ) -> None:
        self._limit, self._field = limit, field_name
        self._tenant_limit, self._tenant_field = tenant_limit, tenant_field
        self._used = 0
        self._by_tenant: Counter[str] = Counter()
        self._lock = threading.Lock()

    @contextmanager
    def reserve(self, nbytes: int, tenant: Tenant | None = None) -> Iterator[None]:
        """Hold `nbytes` for the duration of the block. LimitExceededError if they are not free,
        the tenant's share first (so that a tenant over its share is told so, not to retry)."""
        with self._lock:
            mine = self._by_tenant[tenant.key] if tenant is not None else 0
            if tenant is not None and self._tenant_limit is not None and mine + nbytes > self._tenant_limit:
                raise LimitExceededError(
                    f"{nbytes} B would bring the Store streams in flight of {tenant.label} to "
                    f"{mine + nbytes} B, above {self._tenant_field}={self._tenant_limit}"
                )
            if self._used + nbytes > self._limit:
                raise LimitExceededError(
                    f"{nbytes} B would bring requests in flight to {self._used + nbytes} B, above "
                    f"{self._field}={self._limit}; retry later"
                )
            self._used += nbytes
            if tenant is not None:
                self._by_tenant[tenant.key] += nbytes
        try:
            yield
        finally:
            with self._lock:
                self._used -= nbytes
                if tenant is not None:
                    self._by_tenant[tenant.key] -= nbytes
                    if not self._by_tenant[tenant.key]:
                        del self._by_tenant[tenant.key]

    @property
    def used(self) -> int:
        """Bytes reserved now."""
        return self._used


class StreamSlots:
    """Long-lived streams (Store, Load, LoadLayers) open per tenant, up to `limit` each
    (thread-safe). The server-wide cap on calls (`max_concurrent_rpcs`) is grpc's; this one
    bites first, so one tenant never holds every call slot."""

    def __init__(self, limit: int, field_name: str) -> None:
        self._limit, self._field = limit, field_name
        self._open: Counter[str] = Counter()
        self._lock = threading.Lock()

    def claim(self, tenant: Tenant) -> None:
        """Count one more stream of `tenant`. LimitExceededError if it has `limit` open."""
        with self._lock:
            if self._open[tenant.key] >= self._limit:
                raise LimitExceededError(
                    f"{tenant.label} has {self._open[tenant.key]} streams open, the most "
                    f"{self._field} allows; end one first"
                )
            self._open[tenant.key] += 1

    def release(self, tenant: Tenant) -> None:
        """One stream of `tenant` ended."""
        with self._lock:
            self._open[tenant.key] -= 1
            if self._open[tenant.key] <= 0:
                del self._open[tenant.key]

    def count(self, tenant: Tenant) -> int:
        """Streams `tenant` has open."""
        with self._lock:
            return self._open[tenant.key]


class StreamSlot:
    """One stream's place among its tenant's: claimed once the tenant is known (at the call's
    start when its token names it, else at its first message), given back once."""

    def __init__(self, slots: StreamSlots) -> None:
        self._slots = slots
        self._tenant: Tenant | None = None
        self._released = False
        self._lock = threading.Lock()

    def claim(self, tenant: Tenant) -> None:
        """Take the slot for `tenant`; nothing if this stream holds one already."""
        with self._lock:
            if self._tenant is None and not self._released:
                self._slots.claim(tenant)
                self._tenant = tenant

    def release(self, *_: object) -> None:
        """Give the slot back (idempotent; usable as a grpc done callback)."""
        with self._lock:
            tenant, self._tenant, self._released = self._tenant, None, True
        if tenant is not None:
            self._slots.release(tenant)


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
    expires_at: float  # inf for a stream's pin: it ends with the stream
    keys: tuple[bytes, ...]


@dataclass
class _Pins:
    leases: dict[str, _Pinned] = field(default_factory=dict)


class TenantLeases:
    """Which namespace holds each pin, and per-namespace caps on pins and pinned bytes.

    Two kinds of pin count alike: leases (Pin, with a TTL) and the pins of live
    LoadLayers streams (`holding`), so no path pins past a namespace's quota.
    Expired leases are pruned on every call, so the map never outgrows the live
    pins. Thread-safe.

    Args:
        max_leases: live pins one namespace may hold.
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
        self._stream_ids = itertools.count(1)
        self._lock = threading.Lock()

    def admit(self, namespace: str, lease: Lease, keys: Sequence[bytes]) -> None:
        """Record a granted lease pinning `keys`, or raise LimitExceededError (the caller then unpins it)."""
        self._add(namespace, lease.lease_id, _Pinned(lease.expires_at, tuple(keys)))

    @contextmanager
    def holding(self, namespace: str, keys: Sequence[bytes]) -> Iterator[None]:
        """Count a stream's pin on `keys` while the block runs (nothing when it pins no block).
        LimitExceededError (the caller then releases its pin) when the namespace's quota has no
        room for it."""
        if not keys:
            yield
            return
        hold_id = f"stream-{next(self._stream_ids)}"
        self._add(namespace, hold_id, _Pinned(float("inf"), tuple(keys)))
        try:
            yield
        finally:
            self.forget(hold_id)

    def namespace_of(self, lease_id: str) -> str | None:
        """The namespace of a live lease, or None."""
        with self._lock:
            self._prune()
            return self._namespace_of.get(lease_id)

    def forget(self, lease_id: str) -> None:
        """A lease (or a stream's pin) was released."""
        with self._lock:
            namespace = self._namespace_of.pop(lease_id, None)
            if namespace is not None:
                pins = self._by_namespace[namespace]
                pins.leases.pop(lease_id, None)
                if not pins.leases:
                    del self._by_namespace[namespace]

    def count(self, namespaces: frozenset[str] | None) -> int:
        """Live pins (leases and streams' pins) of `namespaces` (None: all)."""
        with self._lock:
            self._prune()
            held = self._by_namespace.items()
            return sum(len(p.leases) for ns, p in held if namespaces is None or ns in namespaces)

    def __len__(self) -> int:
        return len(self._namespace_of)

    def _add(self, namespace: str, pin_id: str, pinned: _Pinned) -> None:
        with self._lock:
            self._prune()
            pins = self._by_namespace.setdefault(namespace, _Pins())
            if len(pins.leases) >= self._max_leases:
                raise LimitExceededError(
                    f"namespace {namespace!r} holds {len(pins.leases)} pins (leases and LoadLayers "
                    f"streams), the most namespace_max_leases allows; unpin some or let them expire"
                )
            if self._max_bytes is not None:
                distinct = {k for held in pins.leases.values() for k in held.keys} | set(pinned.keys)
                total = sum(self._block_bytes(k) for k in distinct)
                if total > self._max_bytes:
                    raise LimitExceededError(
                        f"namespace {namespace!r} would pin {total} B, above its quota of "
                        f"{self._max_bytes} B (namespace_pinned_fraction of the store budget)"
                    )
            pins.leases[pin_id] = pinned
            self._namespace_of[pin_id] = namespace

    def _prune(self) -> None:
        now = self._clock()
        for namespace, pins in list(self._by_namespace.items()):
            for lease_id in [lid for lid, held in pins.leases.items() if held.expires_at <= now]:
                del pins.leases[lease_id]
                self._namespace_of.pop(lease_id, None)
            if not pins.leases:
                del self._by_namespace[namespace]
