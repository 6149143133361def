"""The store's side of the shared remote tier: the tier, its breaker and its write-behind.

`TieredStore` holds one `RemoteLink` when a remote tier is configured. Local tiers
commit first; `write` then queues the block for the remote tier (or writes it at
once without write-behind), and no remote failure ever reaches the client: it is
counted. What is counted (`StoreStats.counters`, exported as `kvsieve_remote_*`):

- `remote.errors`, `remote.timeouts`: failed remote calls (reads are misses then).
- `remote.refused`: calls not made because the circuit breaker was open.
- `remote.corrupt`: remote values that were malformed (each one a miss).
- `remote.writes`, `remote.write_failures`, `remote.queue_drops`: blocks written,
  failed, or dropped because the write-behind queue was full or closing.
- `remote.breaker_opens`, `remote.breaker_closes`; gauges `remote.breaker_state`
  (0 closed, 1 open, 2 half-open), `remote.queue_blocks`, `remote.queue_bytes`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from kvstore.config import StoreConfig
from kvstore.errors import RemoteUnavailableError, TierFullError
from kvstore.format.block_meta import BlockMeta
from kvstore.stats import Counters
from kvstore.tiers.remote.breaker import CircuitBreaker
from kvstore.tiers.remote.redis import RedisTier
from kvstore.tiers.remote.writebehind import WriteBehind


def open_link(config: StoreConfig, counters: Counters) -> RemoteLink:
    """The store's link to the remote tier of `config`, counting what it writes in `counters`."""

    def written(nbytes: int) -> None:
        counters.add_many({"bytes_written.redis": nbytes, "remote.writes": 1})

    return RemoteLink(config, on_written=written)


class RemoteLink:
    """The remote tier with its breaker and (optional) write-behind queue. Thread-safe.

    Args:
        config: the store's configuration (remote_* fields).
        on_written: called with the bytes of each block the remote tier accepted.
        clock: the breaker's clock (seconds, monotonic); injected by tests.
    """

    def __init__(
        self,
        config: StoreConfig,
        on_written: Callable[[int], None] = lambda nbytes: None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.tier = RedisTier(
            url=config.remote_url,
            nodes=config.remote_nodes,
            prefix=config.remote_prefix,
            timeout_s=config.remote_timeout_s,
            new_breaker=lambda: CircuitBreaker(
                config.remote_breaker_failures, config.remote_breaker_reset_s, clock=clock or time.monotonic
            ),
        )
        self._on_written = on_written
        self._drain_s = config.remote_drain_s
        self._sync_failures = 0
        self.queue = (
            WriteBehind(self._write_now, config.remote_queue_bytes) if config.remote_write_behind else None
        )

    def write(self, meta: BlockMeta, chunks: Sequence[bytes | memoryview]) -> None:
        """Send a block that local tiers already hold to the remote tier. Never raises."""
        if self.queue is not None:
            self.queue.submit(meta, chunks)
            return
        try:
            self._write_now(meta, chunks)
        except (RemoteUnavailableError, TierFullError):
            self._sync_failures += 1

    def flush(self, timeout_s: float) -> bool:
        """Wait until queued writes have been attempted. True if the queue emptied in time."""
        return True if self.queue is None else self.queue.flush(timeout_s)

    def counters(self) -> dict[str, int]:
        """The `remote.*` counters and gauges (see module docstring)."""
        out = {f"remote.{name}": value for name, value in self.tier.counters().items()}
        breaker = self.tier.breaker_snapshot()
        out["remote.breaker_state"] = int(breaker.state)
        out["remote.breaker_opens"] = breaker.opens
        out["remote.breaker_closes"] = breaker.closes
        if self.queue is None:
            out["remote.write_failures"] = self._sync_failures
            return out
        queued = self.queue.stats()
        out["remote.write_failures"] = queued.failed
        out["remote.queue_drops"] = queued.dropped
        out["remote.queue_blocks"] = queued.pending_blocks
        out["remote.queue_bytes"] = queued.pending_bytes
        return out

    def close(self) -> None:
        """Drain queued writes for up to `remote_drain_s`, then close the connection. Idempotent."""
        if self.queue is not None:
            self.queue.close(self._drain_s)
        self.tier.close()

    def _write_now(self, meta: BlockMeta, chunks: Sequence[bytes | memoryview]) -> None:
        self.tier.put_block(meta, chunks)
        self._on_written(meta.nbytes)
