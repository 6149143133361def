"""Pins against a real `kvsieve serve`: a pin is released only by its owner, and every path that
pins (Pin, LoadLayers) is held to the namespace's pin quota.

Each test does the hostile thing for real over loopback: a record corrupted on disk, the prefix
dropped by the checksum failure and stored again, the old lease or stream ending afterwards; a
tenant refused a Pin that tries to pin the same blocks through LoadLayers streams.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import TINY, corrupt_chunk, make_kv, make_tokens
from hostile import auth_sidecar, wait_until

from bench.common.sidecar import Sidecar
from kvstore.client.kvclient import KVClient
from kvstore.config import StoreConfig
from kvstore.errors import ChecksumError, StoreFullError
from kvstore.keys import block_keys, namespace_digest

B, C = 32, 8  # the test sidecar's block tokens; per-layer chunk tokens
N = 3 * B
Array = np.ndarray[Any, Any]
PREFIX, PREFIX_KV = make_tokens(N, seed=41), make_kv(TINY, N, seed=41)


def _layered_sidecar(tmp_path: Path, disk: str) -> Sidecar:
    # --sync-stores: a prefix is on disk when its Store returns (the tests kill the sidecar, then
    # damage a record on disk)
    return auth_sidecar(
        tmp_path, "--layout", "layered", "--disk-bytes", disk, "--layers-idle-s", "120", "--sync-stores"
    )


def _fill(client: KVClient, count: int, seed: int, namespace: str = "a") -> list[Array]:
    """Store `count` prefixes of two blocks, each call under a second; returns their tokens."""
    stored = []
    for i in range(count):
        tokens = make_tokens(2 * B, seed=seed + i)
        started = time.monotonic()
        client.store(tokens, make_kv(TINY, 2 * B, seed=seed + i), model=TINY, namespace=namespace)
        assert time.monotonic() - started < 1.0
        stored.append(tokens)
    return stored


@pytest.fixture
def dropped_and_stored_again(tmp_path: Path) -> Iterator[tuple[Sidecar, KVClient]]:
    """A sidecar whose PREFIX (tenant a) had its second block fail its checksum; the store dropped
    blocks 1 and 2 then. Yields before the prefix is stored again (the test holds its old pins first)."""
    server = _layered_sidecar(tmp_path, "128KiB")
    with KVClient(server.address, token="tok-a", use_shm=False) as a:
        assert a.store(PREFIX, PREFIX_KV, model=TINY, namespace="a").new_blocks == 3
    server.kill()
    keys = block_keys(PREFIX, B, TINY.fingerprint, namespace_digest("a"))
    pack = TINY.num_layers  # block 1's layer pack (summaries come first); its end is layer 1's record
    corrupt_chunk(StoreConfig(data_dir=tmp_path / "data"), keys[1], pack, offset=-100)
    server.start()  # restarted: memory is empty, the next read of that record comes from disk
    try:
        with KVClient(server.address, token="tok-a", use_shm=False) as a:
            yield server, a
    finally:
        server.kill()


def _drop(a: KVClient) -> None:
    """Read the corrupt record through its own stream: DATA_LOSS, blocks 1 and 2 dropped."""
    with a.open_layers(PREFIX, model=TINY, namespace="a") as victim, pytest.raises(ChecksumError):
        victim.read_layer(1, list(range(N // C)))
    assert a.lookup(PREFIX, model=TINY, namespace="a").num_tokens == B


def _assert_pinned_prefix_survives_pressure(a: KVClient) -> None:
    """The live lease's prefix survives stores that need all the rest of the disk, exact to the byte."""
    filler = _fill(a, 40, seed=900)  # ~180 KiB through a 128 KiB disk
    assert a.lookup(filler[0], model=TINY, namespace="a").num_tokens == 0  # pressure evicted others
    assert a.lookup(PREFIX, model=TINY, namespace="a").num_tokens == N
    covered, positions, kv = a.load_arrays(PREFIX, model=TINY, namespace="a")
    assert covered == N and positions.tolist() == list(range(N))
    wrong = np.sum(np.any(kv != PREFIX_KV, axis=(0, 1, 2, 4)))
    assert wrong == 0


def test_an_old_lease_never_releases_the_pin_of_a_prefix_stored_again(
    dropped_and_stored_again: tuple[Sidecar, KVClient],
) -> None:
    _, a = dropped_and_stored_again
    old = a.pin(PREFIX, model=TINY, namespace="a", ttl_s=600)
    _drop(a)
    assert a.store(PREFIX, PREFIX_KV, model=TINY, namespace="a").new_blocks == 2  # stored again
    new = a.pin(PREFIX, model=TINY, namespace="a", ttl_s=600)
    assert new.num_keys == 3
    a.unpin(old.lease_id)  # the old lease ends: it must release its own pin, not the new one's
    assert a.stats().active_leases == 1
    _assert_pinned_prefix_survives_pressure(a)


def test_an_old_layers_stream_never_releases_the_pin_of_a_prefix_stored_again(
    dropped_and_stored_again: tuple[Sidecar, KVClient],
) -> None:
    _, a = dropped_and_stored_again
    old = a.open_layers(PREFIX, model=TINY, namespace="a")
    assert old.matched_tokens == N  # pins the three blocks
    _drop(a)
    assert a.store(PREFIX, PREFIX_KV, model=TINY, namespace="a").new_blocks == 2
    a.pin(PREFIX, model=TINY, namespace="a", ttl_s=600)
    old.close()  # the old stream ends: its pin is on the dropped nodes, not on the new ones
    assert wait_until(lambda: a.stats().active_leases == 1, timeout_s=5)
    _assert_pinned_prefix_survives_pressure(a)


def test_layers_streams_cannot_pin_past_the_quota_a_pin_was_refused_by(tmp_path: Path) -> None:
    # 128 KiB of disk; tenant a may pin a quarter: 32 KiB. Each prefix of 8 blocks is ~19 KiB.
    server = _layered_sidecar(tmp_path, "128KiB")
    prefixes = [make_tokens(8 * B, seed=60 + i) for i in range(3)]
    try:
        with (
            KVClient(server.address, token="tok-a", use_shm=False) as a,
            KVClient(server.address, token="tok-b", use_shm=False) as b,
        ):
            for i, tokens in enumerate(prefixes):
                a.store(tokens, make_kv(TINY, 8 * B, seed=60 + i), model=TINY, namespace="a")
            lease = a.pin(prefixes[0], model=TINY, namespace="a", ttl_s=600)
            with pytest.raises(StoreFullError, match="namespace_pinned_fraction"):
                a.pin(prefixes[1], model=TINY, namespace="a", ttl_s=600)
            with pytest.raises(StoreFullError, match="namespace_pinned_fraction"):
                a.open_layers(prefixes[1], model=TINY, namespace="a")  # the same pin by a stream
            a.unpin(lease.lease_id)
            with a.open_layers(prefixes[0], model=TINY, namespace="a") as held:  # the stream pins it
                assert held.matched_tokens == 8 * B
                assert a.stats().active_leases == 1  # the stream's pin is one of a's pins
                with pytest.raises(StoreFullError, match="namespace_pinned_fraction"):
                    a.open_layers(prefixes[2], model=TINY, namespace="a")
                with pytest.raises(StoreFullError, match="namespace_pinned_fraction"):
                    a.pin(prefixes[1], model=TINY, namespace="a", ttl_s=600)
                filler = _fill(b, 40, seed=700, namespace="b")  # b needs the disk a did not pin
                assert b.lookup(filler[-1], model=TINY, namespace="b").num_tokens == 2 * B
                assert a.lookup(prefixes[0], model=TINY, namespace="a").num_tokens == 8 * B
                assert held.read_layer(0, [0]).positions.tolist() == list(range(C))
            assert wait_until(lambda: a.stats().active_leases == 0, timeout_s=5)
    finally:
        server.kill()
