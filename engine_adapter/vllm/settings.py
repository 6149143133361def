"""Settings of the vLLM connector, read from `kv_connector_extra_config`.

Kept free of vLLM imports so that the settings (and their errors) can be tested
and documented without vLLM installed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from kvstore.errors import InvalidInputError
from kvstore.keys import validate_namespace

MODES = ("load", "save", "both")
#: Default bound on the KV copies waiting to be sent (about 45k tokens of SmolLM2 in bfloat16,
#: 8k of an 8B Llama): a cap on memory, not an allocation.
DEFAULT_SAVE_QUEUE_BYTES = 1 << 30


@dataclass(frozen=True)
class ConnectorSettings:
    """How the connector reaches the sidecar and what it does there.

    Attributes:
        store: "HOST:PORT" or "unix:PATH" of a running `kvsieve serve`.
        token: bearer token, if the sidecar requires one.
        namespace: tenant whose blocks are read and written.
        mode: "load" (read only), "save" (write only) or "both".
        timeout_s: deadline of one load or store; past it vLLM recomputes (or skips the save).
        lookup_timeout_s: deadline of one lookup (the scheduler waits for it: keep it short).
        retry_after_s: after a failure, calls are skipped (vLLM computes) for this long,
            so a dead sidecar costs one deadline per outage, not one per request.
        block_tokens: the sidecar's block size; only whole blocks are sent to it.
        use_shm: shared memory for loads when the sidecar is on this host.
        save_queue_bytes: bound on the KV copies waiting for the background sender, in
            bytes; a save that does not fit is dropped (counted), never waited for.
            At shutdown the queue gets `timeout_s` to drain.
        kv_events: add `BlockStored` events (medium `STORAGE`) for the blocks kvsieve holds to
            vLLM's own KV event stream. Takes effect only where vLLM publishes KV events
            (`--kv-events-config '{"enable_kv_cache_events": true, ...}'`); false keeps vLLM's
            stream to its GPU blocks.
        kv_events_queue: bound on events waiting for vLLM to drain them (every step); past it
            the oldest are dropped and counted.
        timings_path: append one JSON line per lookup, load and save copy to this file (where the
            time of a hit or a miss goes: `kvsieve bench vllm`'s breakdown); None: no record.
    """

    store: str = "127.0.0.1:50051"
    token: str | None = None
    namespace: str = "default"
    mode: str = "both"
    timeout_s: float = 10.0
    lookup_timeout_s: float = 1.0
    retry_after_s: float = 30.0
    block_tokens: int = 256
    use_shm: bool = True
    save_queue_bytes: int = DEFAULT_SAVE_QUEUE_BYTES
    kv_events: bool = True
    kv_events_queue: int = 10_000
    timings_path: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.store, str) or not (self.store.startswith("unix:") or ":" in self.store):
            raise InvalidInputError(f"kvsieve store must be HOST:PORT or unix:PATH, got {self.store!r}")
        validate_namespace(self.namespace)
        if self.mode not in MODES:
            raise InvalidInputError(f"kvsieve mode must be one of {MODES}, got {self.mode!r}")
        for name in ("timeout_s", "lookup_timeout_s", "retry_after_s"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not 0 < value <= 3600:
                raise InvalidInputError(
                    f"kvsieve {name} must be a number of seconds in (0, 3600], got {value!r}"
                )
        if not isinstance(self.block_tokens, int) or not 1 <= self.block_tokens <= 65536:
            raise InvalidInputError(
                f"kvsieve block_tokens must be an int in [1, 65536], got {self.block_tokens!r}"
            )

        size = self.save_queue_bytes
        if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= 1 << 40:
            raise InvalidInputError(
                f"kvsieve save_queue_bytes must be an int of bytes in [1, 2**40], got {size!r}"
            )
        if not isinstance(self.kv_events, bool):
            raise InvalidInputError(f"kvsieve kv_events must be true or false, got {self.kv_events!r}")
        cap = self.kv_events_queue
        if isinstance(cap, bool) or not isinstance(cap, int) or not 1 <= cap <= 10_000_000:
            raise InvalidInputError(
                f"kvsieve kv_events_queue must be an int of events in [1, 10000000], got {cap!r}"
            )

        path = self.timings_path
        if path is not None and (not isinstance(path, str) or not path):
            raise InvalidInputError(f"kvsieve timings_path must be a file path, got {self.timings_path!r}")

    @property
    def loads(self) -> bool:
        """Whether prefixes are read from the sidecar."""
        return self.mode in ("load", "both")

    @property
    def saves(self) -> bool:
        """Whether new full blocks are written to the sidecar."""
        return self.mode in ("save", "both")

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> ConnectorSettings:
        """Settings from vLLM's `kv_connector_extra_config` (unknown keys are refused).

        Raises:
            InvalidInputError: an unknown key or a bad value, named in the message.
        """
        extra = dict(extra or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise InvalidInputError(
                f"unknown kv_connector_extra_config key(s) {unknown} for KVSieveConnector; "
                f"known: {sorted(known)}"
            )
        return cls(**extra)
