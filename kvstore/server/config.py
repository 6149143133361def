"""Configuration of `kvsieve serve` (one frozen dataclass; the store has its own)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kvstore.errors import InvalidInputError
from kvstore.events.config import EventsConfig
from kvstore.rpc.channel import is_loopback


@dataclass(frozen=True)
class ServerConfig:
    """How the sidecar listens and whom it serves.

    Attributes:
        listen: "HOST:PORT" (port 0 picks a free one) or "unix:PATH".
        metrics_listen: "HOST:PORT" of the Prometheus endpoint; empty disables it.
        max_message_bytes: largest gRPC message in either direction.
        max_concurrent_rpcs: calls served at once; more wait, then fail RESOURCE_EXHAUSTED.
        max_store_tokens: longest prefix one Store call may send.
        auth_tokens: bearer token -> namespaces it may use ("*" = all); empty = no auth.
        tls_cert: PEM certificate; with tls_key, serve TLS only.
        tls_key: PEM private key of tls_cert.
        allow_insecure_remote: bind a non-loopback address without auth (refused otherwise).
        grace_s: seconds SIGTERM waits for in-flight calls before closing the store.
        shm: offer the zero-copy shared-memory path to co-located clients.
        metrics_allow_remote: let metrics_listen bind a non-loopback address (it has no auth).
        max_store_bytes: largest KV one Store stream may declare (tokens x model token bytes).
        max_inflight_store_bytes: KV of all Store streams being received at once.
        max_lookup_tokens: longest token list Lookup, Load, Pin and ReportScores accept.
        namespace_max_leases: live leases (pins) one namespace may hold.
        namespace_pinned_fraction: share of the store's byte budget (disk_bytes, or
            memory_bytes without a disk tier) one namespace may keep pinned.
        namespace_max_bytes: bytes of blocks one namespace may hold before its Stores
            are refused; 0 = no quota (the store's own eviction bounds the total).
        shm_arena_bytes: largest shared-memory arena the server makes for one client.
        shm_namespace_bytes: shared-memory arenas one namespace may hold, in bytes.
        shm_total_bytes: shared-memory arenas of all clients, in bytes.
        shm_idle_s: an arena unused this long is unmapped.
        layers_idle_s: a LoadLayers stream whose client sends no request, or takes no answer
            (a send blocked on flow control), for this long is ended (and its pin released).
        stream_idle_s: a Store stream with no message (its header, then each slice) or a Load
            stream whose client takes no answer for this long is ended, releasing what it holds.
        namespace_max_streams: streams (Store, Load, LoadLayers) one tenant (its bearer token;
            without auth, its namespace) may have open at once; 0 = a quarter of
            max_concurrent_rpcs (see `streams_per_tenant`).
        namespace_max_inflight_bytes: KV of one tenant's Store streams being received at once;
            0 = half of max_inflight_store_bytes, at least max_store_bytes (see
            `inflight_bytes_per_tenant`).
        kv_events: publish KV events for routers (vLLM's format) on this ZMQ address, e.g.
            tcp://127.0.0.1:5557; empty disables (docs/integrations.md).
        kv_events_replay: ZMQ address of the replay socket routers ask for missed batches.
        kv_events_topic: topic frame of every KV event (llm-d: kv@<pod>@<model>).
        kv_events_block_tokens: the router's block size in tokens; divides block_tokens.
        kv_events_connect: connect to a subscriber that binds (llm-d) instead of binding.
        kv_events_allow_remote: let kv_events bind a non-loopback address (events carry every
            tenant's token ids, without auth).
        kv_events_queue: block changes waiting to be published before news is dropped (then a
            snapshot is published).
        kv_events_replay_batches: published batches kept for replay.
        kv_events_heartbeat_s: an empty batch after this many seconds without news.
    """

    listen: str = "127.0.0.1:50051"
    metrics_listen: str = "127.0.0.1:9464"
    max_message_bytes: int = 64 << 20
    max_concurrent_rpcs: int = 64
    max_store_tokens: int = 1 << 17
    auth_tokens: dict[str, list[str]] = field(default_factory=dict)
    tls_cert: Path | None = None
    tls_key: Path | None = None
    allow_insecure_remote: bool = False
    grace_s: float = 10.0
    shm: bool = True
    metrics_allow_remote: bool = False
    max_store_bytes: int = 1 << 30
    max_inflight_store_bytes: int = 2 << 30
    max_lookup_tokens: int = 1 << 20
    namespace_max_leases: int = 1024
    namespace_pinned_fraction: float = 0.25
    namespace_max_bytes: int = 0
    shm_arena_bytes: int = 1 << 30
    shm_namespace_bytes: int = 2 << 30
    shm_total_bytes: int = 4 << 30
    shm_idle_s: float = 60.0
    layers_idle_s: float = 30.0
    stream_idle_s: float = 30.0
    namespace_max_streams: int = 0
    namespace_max_inflight_bytes: int = 0
    kv_events: str = ""
    kv_events_replay: str = ""
    kv_events_topic: str = ""
    kv_events_block_tokens: int = 16
    kv_events_connect: bool = False
    kv_events_allow_remote: bool = False
    kv_events_queue: int = 100_000
    kv_events_replay_batches: int = 10_000
    kv_events_heartbeat_s: float = 1.0

    def __post_init__(self) -> None:
        if not self.listen.startswith("unix:") and ":" not in self.listen:
            raise InvalidInputError(f"listen must be HOST:PORT or unix:PATH, got {self.listen!r}")
        if not 1 << 20 <= self.max_message_bytes <= 2**31 - 1:
            raise InvalidInputError(
                f"max_message_bytes must be in [1 MiB, 2 GiB), got {self.max_message_bytes}"
            )
        if self.max_concurrent_rpcs < 1:
            raise InvalidInputError(f"max_concurrent_rpcs must be >= 1, got {self.max_concurrent_rpcs}")
        self._check_limits()
        self._check_kv_events()
        if (self.tls_cert is None) != (self.tls_key is None):
            raise InvalidInputError("tls_cert and tls_key must be given together")
        if not self.is_loopback and not self.auth_tokens and not self.allow_insecure_remote:
            raise InvalidInputError(
                f"refusing to listen on {self.listen} without auth_tokens: anyone on the network "
                "could read and write every tenant's KV; configure auth_tokens or set "
                "allow_insecure_remote"
            )

    def _check_limits(self) -> None:
        positive = "max_store_bytes max_inflight_store_bytes max_lookup_tokens namespace_max_leases"
        positive += " shm_arena_bytes shm_namespace_bytes shm_total_bytes"
        for name in positive.split():
            if getattr(self, name) < 1:
                raise InvalidInputError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_inflight_store_bytes < self.max_store_bytes:
            raise InvalidInputError(
                f"max_inflight_store_bytes ({self.max_inflight_store_bytes}) must be >= "
                f"max_store_bytes ({self.max_store_bytes})"
            )
        if not 0.0 < self.namespace_pinned_fraction <= 1.0:
            raise InvalidInputError(
                f"namespace_pinned_fraction must be in (0, 1], got {self.namespace_pinned_fraction}"
            )
        if self.namespace_max_bytes < 0 or self.shm_idle_s <= 0:
            raise InvalidInputError("namespace_max_bytes must be >= 0 and shm_idle_s > 0")
        for name in ("layers_idle_s", "stream_idle_s"):
            if not 0 < getattr(self, name) <= 3600:
                raise InvalidInputError(f"{name} must be in (0, 3600], got {getattr(self, name)}")
        self._check_tenant_shares()
        if self.metrics_listen and not self.metrics_is_loopback and not self.metrics_allow_remote:
            raise InvalidInputError(
                f"refusing to serve metrics on {self.metrics_listen}: the metrics endpoint has no auth "
                "and shows every tenant's figures; bind a loopback address (127.0.0.1:PORT) or set "
                "metrics_allow_remote (--metrics-allow-remote)"
            )

    def _check_kv_events(self) -> None:
        if not self.kv_events and self.kv_events_replay:
            raise InvalidInputError("kv_events_replay needs kv_events (the publishing address)")
        self.events_config("CPU")  # validates the addresses and sizes
        for name in ("kv_events", "kv_events_replay"):
            address = getattr(self, name)
            host_port = address.removeprefix("tcp://")
            if (
                address.startswith("tcp://")
                and not is_loopback(host_port)
                and not self.kv_events_allow_remote
            ):
                raise InvalidInputError(
                    f"refusing to publish KV events on {address}: they carry every tenant's token ids "
                    "and have no auth; use a loopback address (tcp://127.0.0.1:PORT) or set "
                    "kv_events_allow_remote (--kv-events-allow-remote)"
                )

    def events_config(self, medium: str) -> EventsConfig | None:
        """The KV-event publisher's configuration (None when kv_events is empty)."""
        if not self.kv_events:
            return None
        return EventsConfig(
            self.kv_events, self.kv_events_replay, self.kv_events_topic, self.kv_events_block_tokens,
            self.kv_events_connect, self.kv_events_queue, self.kv_events_replay_batches,
            self.kv_events_heartbeat_s, medium,
        )  # fmt: skip

    def _check_tenant_shares(self) -> None:
        """A tenant's share of a server-wide limit must leave room for the others."""
        streams = self.namespace_max_streams
        if streams and not 1 <= streams < self.max_concurrent_rpcs:
            raise InvalidInputError(
                f"namespace_max_streams must be 0 (a quarter of max_concurrent_rpcs) or in [1, "
                f"max_concurrent_rpcs={self.max_concurrent_rpcs}), got {streams}"
            )
        inflight = self.namespace_max_inflight_bytes
        if inflight and not self.max_store_bytes <= inflight <= self.max_inflight_store_bytes:
            raise InvalidInputError(
                f"namespace_max_inflight_bytes must be 0 (half of max_inflight_store_bytes) or in "
                f"[max_store_bytes={self.max_store_bytes}, max_inflight_store_bytes="
                f"{self.max_inflight_store_bytes}], got {inflight}"
            )

    @property
    def streams_per_tenant(self) -> int:
        """Streams one tenant may have open: `namespace_max_streams`, or a quarter of
        `max_concurrent_rpcs` (at least 1), so that grpc's server-wide cap is never one tenant's."""
        return self.namespace_max_streams or max(1, self.max_concurrent_rpcs // 4)

    @property
    def inflight_bytes_per_tenant(self) -> int:
        """Store bytes one tenant may have in flight: `namespace_max_inflight_bytes`, or half of
        `max_inflight_store_bytes` (at least `max_store_bytes`, so one Store of any allowed size fits)."""
        return self.namespace_max_inflight_bytes or max(
            self.max_store_bytes, self.max_inflight_store_bytes // 2
        )

    @property
    def metrics_is_loopback(self) -> bool:
        """Whether `metrics_listen` stays on this machine (an empty host means 127.0.0.1)."""
        host = self.metrics_listen.rpartition(":")[0]
        return not host or is_loopback(self.metrics_listen)

    @property
    def is_loopback(self) -> bool:
        """Whether `listen` is a unix socket or a loopback address."""
        return is_loopback(self.listen)
