"""Counters of the store, and the typed snapshot `TieredStore.stats()` returns."""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import NamedTuple


class TierUsage(NamedTuple):
    """Occupancy of a tier, in bytes of encoded chunks (metadata excluded)."""

    used_bytes: int
    capacity_bytes: int | None
    num_blocks: int
    num_chunks: int


@dataclass(frozen=True)
class StoreStats:
    """A snapshot of the store's counters and tier occupancy.

    Counter names: `lookups`, `loads`, `stores`, `blocks_written`, `chunk_hits.<tier>`,
    `chunk_misses`, `bytes_read.<tier>`, `bytes_written.<tier>`, `bytes_selected`,
    `checksum_failures`, `geometry_mismatches` (records whose header describes another chunk
    size, chunk count, layer, dtype or shape than their block's metadata and the model: never
    used, each one a miss), `blocks_dropped` (blocks forgotten as lost, corrupt or mismatched,
    with those below them: gone from every local tier), `evictions.<tier>` (blocks),
    `leases_expired`.
    """

    counters: dict[str, int]
    tiers: dict[str, TierUsage]
    num_blocks: int
    active_leases: int
    read_amplification: list[float] = field(default_factory=list)

    def get(self, name: str) -> int:
        """A counter, 0 if never incremented."""
        return self.counters.get(name, 0)


class Counters:
    """Thread-safe monotonically increasing counters, plus recent read amplifications."""

    def __init__(self, keep_samples: int = 1024) -> None:
        self._counts: Counter[str] = Counter()
        self._samples: list[float] = []
        self._keep = keep_samples
        self._lock = threading.Lock()

    def add(self, name: str, amount: int = 1) -> None:
        """Increase a counter."""
        with self._lock:
            self._counts[name] += amount

    def add_many(self, amounts: dict[str, int]) -> None:
        """Increase several counters under one lock acquisition."""
        with self._lock:
            self._counts.update(amounts)

    def sample_read_amplification(self, value: float) -> None:
        """Record one load's read amplification (bytes read / bytes of selected tokens)."""
        with self._lock:
            self._samples.append(value)
            del self._samples[: -self._keep]

    def snapshot(self) -> tuple[dict[str, int], list[float]]:
        """Copies of the counters and the recent samples."""
        with self._lock:
            return dict(self._counts), list(self._samples)
