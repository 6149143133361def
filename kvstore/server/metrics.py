"""Prometheus metrics of the sidecar.

Store counters are read from `TieredStore.stats()` at scrape time by a collector,
so there is one set of books; only request-level figures (latency, read
amplification, active streams) are recorded here.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvstore.api import PrefixStore
from kvstore.events.publisher import Publisher


class StoreCollector:
    """Exposes the store's counters and tier usage as Prometheus metrics."""

    def __init__(self, store: PrefixStore) -> None:
        self._store = store

    def collect(self) -> Iterator[Any]:
        stats = self._store.stats()
        per_tier = {
            "chunk_hits": CounterMetricFamily("kvsieve_chunk_hits", "Chunks read, by tier", labels=["tier"]),
            "bytes_read": CounterMetricFamily("kvsieve_read_bytes", "Bytes read, by tier", labels=["tier"]),
            "bytes_written": CounterMetricFamily(
                "kvsieve_written_bytes", "Bytes written, by tier", labels=["tier"]
            ),
            "evictions": CounterMetricFamily("kvsieve_evictions", "Evictions, by tier", labels=["tier"]),
        }
        for name, value in stats.counters.items():
            family, _, tier = name.partition(".")
            if family in per_tier and tier:
                per_tier[family].add_metric([tier], value)
        yield from per_tier.values()
        for name, help_text in (
            ("lookups", "Lookup calls"), ("loads", "Load calls"), ("stores", "Store calls"),
            ("chunk_misses", "Chunks absent from every tier"),
            ("checksum_failures", "Chunks whose checksum or identity did not match"),
            ("leases_expired", "Leases that expired unreleased"),
        ):  # fmt: skip
            yield CounterMetricFamily(f"kvsieve_{name}", help_text, value=stats.get(name))
        hits, lookups = stats.get("lookup_hits"), stats.get("lookups")
        yield CounterMetricFamily("kvsieve_lookup_hits", "Lookups that matched >= 1 block", value=hits)
        yield CounterMetricFamily(
            "kvsieve_lookup_misses", "Lookups that matched nothing", value=lookups - hits
        )
        used = GaugeMetricFamily("kvsieve_tier_used_bytes", "Bytes held, by tier", labels=["tier"])
        for tier, usage in stats.tiers.items():
            used.add_metric([tier], usage.used_bytes)
        yield used
        yield GaugeMetricFamily("kvsieve_active_leases", "Leases in force", value=stats.active_leases)
        yield GaugeMetricFamily("kvsieve_blocks", "Blocks in the index", value=stats.num_blocks)
        yield from _remote_metrics(stats.counters)


# The remote tier's `remote.*` counters (kvstore/tiers/remote/link.py); these three are levels, not totals.
_REMOTE_GAUGES = {"breaker_state": "Remote breaker state: 0 closed, 1 open, 2 half-open (worst node)",
                  "queue_blocks": "Blocks waiting in the write-behind queue",
                  "queue_bytes": "Bytes waiting in the write-behind queue"}  # fmt: skip


def _remote_metrics(counters: dict[str, int]) -> Iterator[Any]:
    """`remote.X` counters as kvsieve_remote_X (errors, timeouts, refused, corrupt, writes,
    write_failures, queue_drops, breaker_opens, breaker_closes) and the gauges above."""
    for name, value in sorted(counters.items()):
        family, _, what = name.partition(".")
        if family != "remote" or not what:
            continue
        if what in _REMOTE_GAUGES:
            yield GaugeMetricFamily(f"kvsieve_remote_{what}", _REMOTE_GAUGES[what], value=value)
        else:
            yield CounterMetricFamily(f"kvsieve_remote_{what}", f"Remote tier: {what}", value=value)


class EventsCollector:
    """The KV-event publisher's counters (kvstore/events/publisher.py)."""

    def __init__(self, publisher: Publisher) -> None:
        self._publisher = publisher

    def collect(self) -> Iterator[Any]:
        stats = self._publisher.stats()
        for name, value, help_text in (
            ("batches", stats.batches, "KV-event batches published"),
            ("events", stats.events, "KV events published"),
            ("dropped", stats.dropped, "Block changes dropped because the event queue was full"),
            ("resyncs", stats.resyncs, "Snapshots published after dropped changes"),
            ("replays", stats.replays, "Replay requests answered"),
            ("replays_refused", stats.replays_refused, "Replay requests over a bound: the end marker alone"),
            ("snapshots", stats.snapshots, "Snapshots built for replay answers (each shared by its state)"),
        ):
            yield CounterMetricFamily(f"kvsieve_kv_events_{name}", help_text, value=value)
        yield GaugeMetricFamily("kvsieve_kv_events_queued", "Block changes waiting", value=stats.queued)


class Metrics:
    """Request-level metrics plus the store collector, in a registry of their own."""

    def __init__(self, store: PrefixStore) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(StoreCollector(store))
        self.load_seconds = Histogram(
            "kvsieve_load_seconds", "Load call latency", registry=self.registry,
            buckets=(0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1, 3, 10),
        )  # fmt: skip
        self.read_amplification = Histogram(
            "kvsieve_read_amplification", "Bytes read / bytes of the selected tokens, per load",
            registry=self.registry, buckets=(1.0, 1.05, 1.1, 1.2, 1.5, 2, 3, 5, 10),
        )  # fmt: skip
        self.active_streams = Gauge(
            "kvsieve_active_streams", "Store and Load streams in flight", registry=self.registry
        )
        self.inflight_store_bytes = Gauge(
            "kvsieve_inflight_store_bytes", "KV bytes reserved by Store streams being received",
            registry=self.registry,
        )  # fmt: skip
        self.arenas = Gauge("kvsieve_shm_arenas", "Shared-memory arenas mapped", registry=self.registry)
