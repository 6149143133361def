"""Pins granted over the wire, counted against their namespace's pinned-bytes quota.

A pin keeps blocks from eviction, so an unbounded tenant could pin the whole budget
that eviction works with; `TenantLeases` (kvstore/server/limits.py) counts each
namespace's pinned bytes, and a pin over the quota is given back before it is refused.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvstore.api import Lease
from kvstore.errors import LimitExceededError
from kvstore.model import ModelSpec
from kvstore.server.backend import SidecarStore
from kvstore.server.limits import TenantLeases


def pinned_quota(store: SidecarStore, namespace_pinned_fraction: float) -> int | None:
    """Bytes one namespace may keep pinned: a share of the budget pins could exhaust
    (None: the store has no such budget, so no quota)."""
    budget = store.pinnable_bytes()
    return None if budget is None else int(budget * namespace_pinned_fraction)


def pin_admitted(
    store: SidecarStore,
    leases: TenantLeases,
    tokens: np.ndarray[Any, Any],
    model: ModelSpec,
    namespace: str,
    ttl_s: float,
) -> Lease:
    """Pin `tokens`' blocks for `ttl_s` seconds and count the lease against `namespace`'s quota;
    LimitExceededError (the pin released again) when it would go over."""
    lease = store.pin(tokens, model=model, namespace=namespace, ttl_s=ttl_s)
    try:
        leases.admit(namespace, lease, store.lease_keys(lease.lease_id))
    except LimitExceededError:
        store.unpin(lease.lease_id)
        raise
    return lease
