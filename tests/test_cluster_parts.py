"""The remote tier's parts on their own: circuit breaker (clock injected), write-behind
queue, remote configuration, and the cluster key layout (one slot per block)."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from kvstore.config import StoreConfig
from kvstore.errors import InvalidInputError
from kvstore.format.block_meta import BlockMeta
from kvstore.tiers.remote.breaker import BreakerState, CircuitBreaker
from kvstore.tiers.remote.writebehind import WriteBehind
from tests.test_tiers_contract import make_block


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_breaker_opens_after_threshold_then_probes_one_at_a_time() -> None:
    clock = FakeClock()
    breaker = CircuitBreaker(failure_threshold=3, reset_s=2.0, clock=clock)
    for _ in range(2):
        assert breaker.allow()
        breaker.failure()
    assert breaker.snapshot().state is BreakerState.CLOSED
    assert breaker.allow()
    breaker.failure()
    assert breaker.snapshot().state is BreakerState.OPEN
    assert not breaker.allow()
    clock.now += 1.999
    assert not breaker.allow()
    clock.now += 0.002
    assert breaker.allow()  # the probe
    assert breaker.snapshot().state is BreakerState.HALF_OPEN
    assert not breaker.allow()  # only one probe in flight
    breaker.success()
    snap = breaker.snapshot()
    assert (snap.state, snap.opens, snap.closes, snap.refused) == (BreakerState.CLOSED, 1, 1, 3)
    assert breaker.allow()


def test_breaker_backs_off_exponentially_while_probes_fail() -> None:
    clock = FakeClock()
    breaker = CircuitBreaker(failure_threshold=1, reset_s=1.0, max_backoff_s=4.0, clock=clock)
    breaker.allow()
    breaker.failure()
    waits = []
    for _ in range(4):
        start = clock.now
        while not breaker.allow():
            clock.now += 0.25
        waits.append(clock.now - start)
        breaker.failure()  # the probe failed
    assert waits == [1.0, 2.0, 4.0, 4.0]
    while not breaker.allow():
        clock.now += 0.25
    breaker.success()
    breaker.allow()
    breaker.failure()  # after closing, the wait starts again from reset_s
    assert breaker.snapshot().backoff_s == 1.0


def test_success_in_closed_state_resets_the_failure_count() -> None:
    breaker = CircuitBreaker(failure_threshold=2, clock=FakeClock())
    for _ in range(5):
        breaker.failure()
        breaker.success()
    assert breaker.snapshot().state is BreakerState.CLOSED


def _blocked_writer() -> tuple[threading.Event, list[bytes], object]:
    release = threading.Event()
    written: list[bytes] = []

    def write(meta: BlockMeta, chunks: Sequence[bytes]) -> None:
        assert release.wait(30), "test never released the writer"
        written.append(meta.key)

    return release, written, write


def test_full_queue_drops_and_counts_without_blocking() -> None:
    release, written, write = _blocked_writer()
    a, _ = make_block(1)
    queue = WriteBehind(write, max_bytes=2 * a.nbytes)  # type: ignore[arg-type]
    results = [queue.submit(*make_block(k)) for k in (1, 2, 3, 4)]
    # One block may already be on the worker (out of the queue), so 3 or 4 get in... but the
    # queue holds at most two blocks' bytes: at least one is dropped, and submit returned.
    assert results[:2] == [True, True]
    assert not all(results)
    stats = queue.stats()
    assert stats.dropped == results.count(False) and stats.pending_bytes <= 2 * a.nbytes
    release.set()
    final = queue.close(drain_s=10)
    assert not queue.worker_alive
    assert final.written == results.count(True) and sorted(written) == sorted(
        make_block(k)[0].key for k, ok in zip((1, 2, 3, 4), results, strict=True) if ok
    )


def test_close_drains_queued_writes() -> None:
    written: list[bytes] = []
    queue = WriteBehind(lambda meta, chunks: written.append(meta.key), max_bytes=1 << 20)
    for k in (5, 6, 7):
        assert queue.submit(*make_block(k))
    final = queue.close(drain_s=10)
    assert not queue.worker_alive
    assert written == [make_block(k)[0].key for k in (5, 6, 7)]
    assert (final.written, final.dropped, final.pending_blocks) == (3, 0, 0)
    assert not queue.submit(*make_block(8))  # closed: dropped, counted
    assert queue.stats().dropped == 1


def test_close_past_its_deadline_drops_what_is_left() -> None:
    release, written, write = _blocked_writer()
    queue = WriteBehind(write, max_bytes=1 << 20)  # type: ignore[arg-type]
    for k in (9, 10, 11):
        queue.submit(*make_block(k))
    closer = threading.Thread(target=queue.close, kwargs={"drain_s": 0.05})
    closer.start()
    deadline = time.monotonic() + 30
    while queue.stats().dropped < 2 and time.monotonic() < deadline:  # close gave up on two
        time.sleep(0.01)
    release.set()  # the write that was on the wire completes
    closer.join(30)
    assert not closer.is_alive() and not queue.worker_alive
    final = queue.stats()
    assert (final.written, final.dropped) == (1, 2) and written == [make_block(9)[0].key]


def test_failing_writes_are_counted_not_raised() -> None:
    def write(meta: BlockMeta, chunks: Sequence[bytes]) -> None:
        raise ConnectionError("remote down")

    queue = WriteBehind(write, max_bytes=1 << 20)
    queue.submit(*make_block(12))
    assert queue.flush(10)
    assert queue.close(drain_s=1).failed == 1


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"remote_url": "redis://h:1", "remote_nodes": ("a:1",)}, "not both"),
        ({"remote_nodes": ("a:1", "nope")}, "HOST:PORT"),
        ({"remote_url": "http://h:1"}, "remote_url"),
        ({"remote_url": "redis://h:1", "remote_timeout_s": 0.0}, "remote_timeout_s"),
        ({"remote_url": "redis://h:1", "remote_queue_bytes": 0}, "remote_queue_bytes"),
        ({"remote_url": "redis://h:1", "remote_prefix": "a{b}"}, "remote_prefix"),
        ({"remote_url": "redis://h:1", "remote_breaker_failures": 0}, "remote_breaker_failures"),
    ],
)
def test_bad_remote_config_names_the_field(fields: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidInputError, match=message):
        StoreConfig(**fields)  # type: ignore[arg-type]


def test_remote_nodes_from_a_comma_separated_string() -> None:
    from kvstore.cli.settings import build_config

    config = build_config(StoreConfig, env={"KVSIEVE_REMOTE_NODES": "10.0.0.1:7000, 10.0.0.2:7000"})
    assert config.remote_nodes == ("10.0.0.1:7000", "10.0.0.2:7000") and config.has_remote


def test_every_key_of_a_block_hashes_to_one_slot(redis_cluster: object) -> None:
    from redis.crc import key_slot

    from kvstore.tiers.remote.redis import RedisTier

    tier = RedisTier(nodes=redis_cluster.addresses, prefix="slots")  # type: ignore[attr-defined]
    meta, _ = make_block(13, num_chunks=8)
    keys = [tier._mkey(meta.key), *tier._chunk_keys(meta)]
    assert len({key_slot(k) for k in keys}) == 1
    other, _ = make_block(14)
    assert key_slot(tier._mkey(other.key)) != key_slot(keys[0])  # the tag is the block, not the prefix
    tier.close()


def test_the_documented_cluster_configuration_is_valid(tmp_path: Path) -> None:
    import re

    from kvstore.cli.settings import build_config

    text = (Path(__file__).resolve().parent.parent / "docs" / "sidecar.md").read_text()
    block = next(b for b in re.findall(r"```toml\n(.*?)```", text, re.S) if "remote_nodes" in b)
    (tmp_path / "kvsieve.toml").write_text(block)
    config = build_config(StoreConfig, tmp_path / "kvsieve.toml", env={}, section="store")
    assert config.remote_nodes == ("10.0.0.11:7000", "10.0.0.12:7000", "10.0.0.13:7000")
    assert config.remote_queue_bytes == 256 << 20 and config.remote_write_behind
