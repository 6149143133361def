"""Configuration of `kvsieve serve` (one frozen dataclass; the store has its own)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kvstore.errors import InvalidInputError
from kvstore.transport import is_loopback


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

    def __post_init__(self) -> None:
        if not self.listen.startswith("unix:") and ":" not in self.listen:
            raise InvalidInputError(f"listen must be HOST:PORT or unix:PATH, got {self.listen!r}")
        if not 1 << 20 <= self.max_message_bytes <= 2**31 - 1:
            raise InvalidInputError(
                f"max_message_bytes must be in [1 MiB, 2 GiB), got {self.max_message_bytes}"
            )
        if self.max_concurrent_rpcs < 1:
            raise InvalidInputError(f"max_concurrent_rpcs must be >= 1, got {self.max_concurrent_rpcs}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise InvalidInputError("tls_cert and tls_key must be given together")
        if not self.is_loopback and not self.auth_tokens and not self.allow_insecure_remote:
            raise InvalidInputError(
                f"refusing to listen on {self.listen} without auth_tokens: anyone on the network "
                "could read and write every tenant's KV; configure auth_tokens or set "
                "allow_insecure_remote"
            )

    @property
    def is_loopback(self) -> bool:
        """Whether `listen` is a unix socket or a loopback address."""
        return is_loopback(self.listen)
