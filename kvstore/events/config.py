"""Configuration of the KV-event publisher (kvstore/events/publisher.py): one frozen dataclass,
checked when it is made, and the tier label a store's blocks are published with."""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.errors import InvalidInputError

SCHEMES = ("tcp://", "ipc://", "inproc://")


@dataclass(frozen=True)
class EventsConfig:
    """Where and how KV events are published.

    Attributes:
        endpoint: ZMQ address of the PUB socket ("tcp://HOST:PORT", "ipc://PATH").
        replay_endpoint: ZMQ address of the replay (ROUTER) socket; empty: no replay.
        topic: first frame of every message (llm-d reads `kv@<pod>@<model>`; empty for Dynamo).
        router_block_tokens: the router's block size; must divide the store's block_tokens.
        connect: connect the PUB socket to a subscriber that binds (llm-d) instead of binding.
        queue_size: block changes waiting to be published before news is dropped.
        replay_batches: published batches kept for replay.
        heartbeat_s: an empty batch after this many seconds without news.
        medium: the tier label of the store's blocks (`medium_of` below).
        high_water_mark: messages ZMQ keeps for one subscriber before it drops that
            subscriber's messages (it never blocks the publisher).
        replay_intake_rate: replay requests read per second, all clients together (the rest
            wait in ZMQ's queues; kvstore/events/replay.py).
        replay_client_rate, replay_client_burst: replay answers per second one client (ROUTER
            identity) may get, and how many at once; over the bound: the end marker alone.
        replay_total_rate, replay_total_burst: the same bound for all clients together.
    """

    endpoint: str
    replay_endpoint: str = ""
    topic: str = ""
    router_block_tokens: int = 16
    connect: bool = False
    queue_size: int = 100_000
    replay_batches: int = 10_000
    heartbeat_s: float = 1.0
    medium: str = "CPU"
    high_water_mark: int = 10_000
    # A router asks for a replay when it (re)starts or sees a gap: a few a second is generous.
    replay_intake_rate: float = 200.0
    replay_client_rate: float = 2.0
    replay_client_burst: int = 4
    replay_total_rate: float = 16.0
    replay_total_burst: int = 32

    def __post_init__(self) -> None:
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if (value or name == "endpoint") and not value.startswith(SCHEMES):
                raise InvalidInputError(
                    f"kv_events {name} must start with one of {', '.join(SCHEMES)}, got {value!r}"
                )
        if self.replay_endpoint and self.replay_endpoint == self.endpoint:
            raise InvalidInputError("kv_events replay endpoint must differ from the publishing endpoint")
        if min(self.router_block_tokens, self.queue_size, self.replay_batches, self.high_water_mark) < 1:
            raise InvalidInputError(
                "kv_events_block_tokens, kv_events_queue, kv_events_replay_batches and the high-water "
                f"mark must be >= 1, got {self.router_block_tokens}, {self.queue_size}, "
                f"{self.replay_batches}, {self.high_water_mark}"
            )
        self._check_replay_bounds()
        if not 0 < self.heartbeat_s <= 3600:
            raise InvalidInputError(f"kv_events_heartbeat_s must be in (0, 3600], got {self.heartbeat_s}")

    def _check_replay_bounds(self) -> None:
        rates = (self.replay_intake_rate, self.replay_client_rate, self.replay_total_rate)
        if not all(rate > 0 for rate in rates) or min(self.replay_client_burst, self.replay_total_burst) < 1:
            raise InvalidInputError(
                "kv_events replay rates must be > 0 and bursts >= 1, got rates "
                f"{rates} and bursts {self.replay_client_burst}, {self.replay_total_burst}"
            )

    def check_block_tokens(self, block_tokens: int) -> None:
        """Refuse a router block size that does not divide the store's blocks."""
        if block_tokens % self.router_block_tokens:
            raise InvalidInputError(
                f"kv_events_block_tokens ({self.router_block_tokens}) must divide the store's "
                f"block_tokens ({block_tokens})"
            )


def medium_of(has_disk: bool, has_remote: bool) -> str:
    """The tier label a router is given for the store's blocks: where every listed block is
    held whole. vLLM's labels, which Dynamo weighs: "CPU" (host memory), "STORAGE" (disk, and
    a shared remote tier; Dynamo counts both as its lower tier)."""
    return "STORAGE" if has_disk or has_remote else "CPU"
