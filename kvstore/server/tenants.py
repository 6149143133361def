"""Per-tenant books: what `Stats` shows a token that is not an admin.

The store keeps global counters (the admin's and the metrics endpoint's view);
the servicer counts each namespace's own calls here, and a tenant's `Stats` is
built only from these and from its own blocks in the index, so one tenant never
sees another's lookups, loads, bytes or leases.
"""

from __future__ import annotations

import threading
from collections import Counter

from kvstore.keys import namespace_digest
from kvstore.server.backend import SidecarStore
from kvstore.stats import StoreStats, TierUsage


class TenantCounters:
    """Thread-safe counters per namespace."""

    def __init__(self) -> None:
        self._counts: dict[str, Counter[str]] = {}
        self._lock = threading.Lock()

    def add(self, namespace: str, amounts: dict[str, int]) -> None:
        """Increase some of a namespace's counters."""
        with self._lock:
            self._counts.setdefault(namespace, Counter()).update(amounts)

    def total(self, namespaces: frozenset[str]) -> dict[str, int]:
        """Sum of the counters of `namespaces`."""
        out: Counter[str] = Counter()
        with self._lock:
            for namespace in namespaces:
                out.update(self._counts.get(namespace, {}))
        return dict(out)


def namespace_usage(store: SidecarStore, namespaces: frozenset[str]) -> tuple[int, int]:
    """(blocks, bytes) the index holds for `namespaces`. O(blocks in the store)."""
    return store.namespace_usage({namespace_digest(ns) for ns in namespaces})


def tenant_stats(
    store: SidecarStore, counters: TenantCounters, namespaces: frozenset[str], active_leases: int
) -> StoreStats:
    """The figures of `namespaces` only: their calls, blocks, bytes and leases.

    Tier usage is reported as one "namespace" entry (the tenant's own blocks and
    bytes), never the shared tiers' totals.
    """
    blocks, nbytes = namespace_usage(store, namespaces)
    tiers = {"namespace": TierUsage(nbytes, None, blocks, 0)}
    return StoreStats(counters.total(namespaces), tiers, blocks, active_leases, [])
