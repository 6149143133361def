"""The shared tier end to end: stores over a real Redis Cluster (and a real Redis), with
sidecar processes, killed nodes, a hung server, corrupt values and local eviction."""

from __future__ import annotations

import urllib.request
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import TINY, make_kv, make_tokens, require_redis_server

from bench.common.sidecar import Sidecar
from kvstore.api import PrefixStore
from kvstore.client.kvclient import KVClient
from kvstore.config import StoreConfig
from kvstore.format.block_meta import layered_layout_version
from kvstore.keys import block_keys, namespace_digest
from kvstore.model import ModelSpec
from kvstore.store.tiered import TieredStore
from kvstore.tiers.remote.breaker import BreakerState, CircuitBreaker
from kvstore.values import DEFAULT_NAMESPACE

B = 32  # block_tokens of every store here


def loaded_records(layout: str, model: ModelSpec) -> list[bytes]:
    """The suffixes of a block's remote keys that a full load reads: its 4 chunks (importance
    layout), or its layer pack (layered, the default: the key summaries are not read)."""
    if layout == "importance":
        return [b":c:0:%d" % i for i in range(B // 8)]
    return [b":c:%d:%d" % (layered_layout_version(8), model.num_layers)]


def remote_config(data_dir: Path | None, **remote: Any) -> StoreConfig:
    memory = remote.pop("memory_bytes", 64 << 20)
    return StoreConfig(data_dir=data_dir, block_tokens=B, chunk_tokens=8, memory_bytes=memory, **remote)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def with_fake_clock(store: TieredStore, failures: int = 2) -> FakeClock:
    """Give the store's breaker a clock the test moves (no wall-clock waits)."""
    clock = FakeClock()
    assert store.remote_link is not None
    store.remote_link.tier.breaker = CircuitBreaker(failure_threshold=failures, reset_s=5.0, clock=clock)
    return clock


def block_slots(tokens: np.ndarray[Any, Any]) -> list[int]:
    from redis.crc import key_slot

    keys = block_keys(tokens, B, TINY.fingerprint, namespace_digest(DEFAULT_NAMESPACE))
    return [key_slot(b"{" + k.hex().encode() + b"}") for k in keys]


def test_prefix_stored_through_one_sidecar_loads_bit_exact_through_another(
    tmp_path: Path, redis_cluster: Any
) -> None:
    args = ["--remote-nodes", ",".join(redis_cluster.addresses), "--remote-prefix", uuid.uuid4().hex]
    tokens, kv = make_tokens(160, seed=1), make_kv(TINY, 160, seed=1)
    first = Sidecar(tmp_path / "a", args).start()
    try:
        with KVClient(first.address) as client:
            client.store(tokens, kv, model=TINY)
    finally:
        code, err = first.terminate()  # SIGTERM drains the write-behind queue
    assert code == 0, err
    second = Sidecar(tmp_path / "b", args).start()
    try:
        with KVClient(second.address, use_shm=False) as client:
            covered, positions, loaded = client.load_arrays(tokens, model=TINY)
            stats = client.stats()
        metrics_url = f"http://127.0.0.1:{second.metrics_port}/metrics"
        metrics = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    finally:
        second.kill()
    assert covered == 160 and loaded.tobytes() == kv.tobytes()
    assert positions.tolist() == list(range(160))
    assert stats.get("chunk_hits.redis") == 5 and stats.get("blocks_learned.redis") == 5  # a pack each
    assert "kvsieve_remote_breaker_state 0.0" in metrics and "kvsieve_remote_queue_drops_total 0.0" in metrics


def test_killed_cluster_node_loses_only_its_blocks_and_writes_resume(
    tmp_path: Path, private_cluster: Any
) -> None:
    nodes, prefix = private_cluster.addresses, uuid.uuid4().hex
    tokens, kv = make_tokens(320, seed=2), make_kv(TINY, 320, seed=2)
    slots = block_slots(tokens)
    owners = [next(i for i, n in enumerate(private_cluster.nodes) if _owns(n, s)) for s in slots]
    victim = next(o for o in owners if o != owners[0])  # a node holding a later block, not the first
    first_lost = owners.index(victim)
    with TieredStore(remote_config(tmp_path / "a", remote_nodes=nodes, remote_prefix=prefix)) as writer:
        writer.store(tokens, kv, model=TINY)
        assert writer.flush(30)  # committed locally, then sent
        clock = with_fake_clock(writer)
        with TieredStore(remote_config(tmp_path / "b", remote_nodes=nodes, remote_prefix=prefix)) as warm:
            assert warm.load_arrays(tokens, model=TINY)[0] == 320  # now held locally by `warm`
            assert private_cluster.nodes[victim].kill() == -9
            covered, _, loaded = warm.load_arrays(tokens, model=TINY)
            assert covered == 320 and loaded.tobytes() == kv.tobytes()  # served locally
        cold_config = remote_config(tmp_path / "c", remote_nodes=nodes, remote_prefix=prefix)
        with TieredStore(cold_config) as cold:
            covered, _, loaded = cold.load_arrays(tokens, model=TINY)
            # Surviving nodes still serve the blocks before the first lost one; nothing wrong.
            assert covered == first_lost * B
            assert loaded.tobytes() == kv[:, :, :, :covered].tobytes()
        more, more_kv = make_tokens(320, seed=3), make_kv(TINY, 320, seed=3)
        writer.store(more, more_kv, model=TINY)  # no error while a node is down
        assert writer.flush(30)
        down = writer.stats()
        assert down.get("remote.errors") + down.get("remote.timeouts") >= 1
        assert down.get("remote.write_failures") + down.get("remote.refused") >= 1
        private_cluster.restart(victim)
        clock.now += 60  # past the breaker's backoff: the next call probes
        again, again_kv = make_tokens(320, seed=4), make_kv(TINY, 320, seed=4)
        writer.store(again, again_kv, model=TINY)
        assert writer.flush(30)
        assert writer.stats().get("remote.breaker_state") == BreakerState.CLOSED
    with TieredStore(remote_config(tmp_path / "d", remote_nodes=nodes, remote_prefix=prefix)) as reader:
        covered, _, loaded = reader.load_arrays(again, model=TINY)
        assert covered == 320 and loaded.tobytes() == again_kv.tobytes()


def _owns(node: Any, slot: int) -> bool:
    ranges = node.client().execute_command("CLUSTER", "SLOTS")
    port = node.port
    return any(int(r[0]) <= slot <= int(r[1]) and int(r[2][1]) == port for r in ranges)


@pytest.mark.redis
def test_hung_redis_under_load_serves_locally_and_the_breaker_cycles(tmp_path: Path) -> None:
    import os
    import signal
    import threading

    from bench.common.redisd import RedisNode

    require_redis_server()
    server = RedisNode(tmp_path / "redis").start()
    config = remote_config(tmp_path / "a", remote_url=server.url, remote_timeout_s=0.2,
                           remote_breaker_failures=2, remote_breaker_reset_s=0.5)  # fmt: skip
    errors: list[BaseException] = []
    checked = [0]
    stop = threading.Event()

    def work(store: TieredStore, seed: int) -> None:
        try:
            while not stop.is_set():
                seed += 2
                tokens, kv = make_tokens(96, seed=seed), make_kv(TINY, 96, seed=seed)
                store.store(tokens, kv, model=TINY)
                covered, _, loaded = store.load_arrays(tokens, model=TINY)
                assert covered == 96 and loaded.tobytes() == kv.tobytes()
                checked[0] += 1
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    with TieredStore(config) as store:
        threads = [threading.Thread(target=work, args=(store, s)) for s in (0, 1)]
        for t in threads:
            t.start()
        assert server.proc is not None
        os.kill(server.proc.pid, signal.SIGSTOP)  # hung, not refusing: every call times out
        try:
            _wait_for(lambda: store.stats().get("remote.breaker_opens") >= 1)
            during = checked[0]
            _wait_for(lambda: checked[0] > during + 5)  # clients keep being served
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        _wait_for(lambda: store.stats().get("remote.breaker_closes") >= 1)
        # Writes reach Redis again: behind the disk's group commit and the remote queue, so a
        # moment after the breaker closed (it may have closed on a read's probe).
        _wait_for(lambda: store.stats().get("remote.writes") >= 1)
        stop.set()
        for t in threads:
            t.join(60)
            assert not t.is_alive()
        stats = store.stats()
    server.stop()
    assert not errors, errors
    assert stats.get("remote.timeouts") >= 2 and stats.get("remote.refused") >= 1
    assert stats.get("remote.writes") >= 1


def _wait_for(condition: Any, timeout_s: float = 60) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


@pytest.mark.parametrize("layout", ["layered", "importance"])
@pytest.mark.parametrize("damage", ["flip", "truncate", "meta", "evicted"])
def test_damaged_or_missing_remote_value_is_a_counted_miss(
    tmp_path: Path, redis_cluster: Any, damage: str, layout: str
) -> None:
    import redis as redis_py
    from redis.cluster import ClusterNode, RedisCluster

    nodes, prefix = redis_cluster.addresses, uuid.uuid4().hex
    tokens, kv = make_tokens(128, seed=5), make_kv(TINY, 128, seed=5)
    config = remote_config(tmp_path / "a", remote_nodes=nodes, remote_prefix=prefix, layout=layout)
    with TieredStore(config) as writer:
        writer.store(tokens, kv, model=TINY)
    keys = block_keys(tokens, B, TINY.fingerprint, namespace_digest(DEFAULT_NAMESPACE))
    tag = prefix.encode() + b":{" + keys[2].hex().encode() + b"}"
    host, port = nodes[0].split(":")
    client = RedisCluster(startup_nodes=[ClusterNode(host, int(port))])
    chunk_key = tag + loaded_records(layout, TINY)[-1]
    value = bytearray(client.get(chunk_key))
    if damage == "flip":
        value[len(value) // 2] ^= 0x01
        client.set(chunk_key, bytes(value))
    elif damage == "truncate":
        client.set(chunk_key, bytes(value[:40]))
    elif damage == "meta":
        client.set(tag + b":m", client.get(tag + b":m")[:-3])
    else:
        client.delete(chunk_key)  # what maxmemory eviction does to one chunk
    reader_config = remote_config(None, remote_nodes=nodes, remote_prefix=prefix, layout=layout)
    with TieredStore(reader_config) as reader:
        covered, _, loaded = reader.load_arrays(tokens, model=TINY)
        stats = reader.stats()
    assert covered == 2 * B and loaded.tobytes() == kv[:, :, :, : 2 * B].tobytes()
    if damage == "evicted":
        assert stats.get("chunk_misses") == 1 and stats.get("remote.corrupt") == 0
    else:
        assert stats.get("remote.corrupt") == 1
    if damage in ("flip", "truncate"):  # a corrupt block is removed for every reader
        assert client.get(tag + b":m") is None
    client.close()
    assert isinstance(client, redis_py.RedisCluster)


@pytest.mark.redis
def test_redis_evicting_at_maxmemory_gives_misses_never_wrong_kv(tmp_path: Path) -> None:
    from bench.common.redisd import RedisNode

    require_redis_server()
    wide = ModelSpec("test-wide", num_layers=4, num_kv_heads=4, head_dim=32)  # 2 KiB per token
    server = RedisNode(tmp_path / "redis", maxmemory="4mb").start()
    config = remote_config(tmp_path / "a", remote_url=server.url, remote_write_behind=False)
    prompts = [(make_tokens(128, seed=s), make_kv(wide, 128, seed=s)) for s in range(40, 60)]  # 5 MiB
    with TieredStore(config) as writer:
        for tokens, kv in prompts:
            writer.store(tokens, kv, model=wide)
    client = server.client()
    evicted = client.info("stats")["evicted_keys"]
    expected = [_surviving_prefix(client, tokens, wide) for tokens, _ in prompts]  # before any read
    covered_all = []
    with TieredStore(remote_config(None, remote_url=server.url)) as reader:
        for (tokens, kv), expect in zip(prompts, expected, strict=True):
            covered, _, loaded = reader.load_arrays(tokens, model=wide)
            # Redis may evict more while it answers (output buffers count): never more found.
            assert covered <= expect and loaded.tobytes() == kv[:, :, :, :covered].tobytes()
            covered_all.append(covered)
    server.stop()
    # Eviction really happened. How much of what survived is found is not asserted: Redis keeps
    # evicting (sampled LRU) while the reader reads; what matters is the per-load check above.
    assert evicted > 0 and min(expected) < 128 and sum(covered_all) <= sum(expected)


def _surviving_prefix(client: PrefixStore, tokens: np.ndarray[Any, Any], model: ModelSpec) -> int:
    """Tokens up to the first block with a key a full load reads evicted (metadata or its pack)."""
    keys = block_keys(tokens, B, model.fingerprint, namespace_digest(DEFAULT_NAMESPACE))
    suffixes = [b":m", *loaded_records("layered", model)]
    for index, key in enumerate(keys):
        tag = b"kvsieve:{" + key.hex().encode() + b"}"
        if client.exists(*[tag + suffix for suffix in suffixes]) != len(suffixes):
            return index * B
    return len(keys) * B


def test_local_disk_eviction_keeps_the_block_in_the_shared_tier(tmp_path: Path, redis_url: str) -> None:
    prefix = uuid.uuid4().hex
    first, first_kv = make_tokens(64, seed=8), make_kv(TINY, 64, seed=8)
    block_bytes = TINY.token_bytes * B
    config = remote_config(tmp_path / "a", remote_url=redis_url, remote_prefix=prefix,
                           disk_bytes=int(3.5 * block_bytes), remote_write_behind=False)  # fmt: skip
    with TieredStore(config) as small:
        small.store(first, first_kv, model=TINY)
        for seed in (9, 10):
            small.store(make_tokens(64, seed=seed), make_kv(TINY, 64, seed=seed), model=TINY)
        assert small.stats().get("evictions.disk") >= 1
        assert (
            small.tree.match((namespace_digest(DEFAULT_NAMESPACE), TINY.fingerprint), first).num_tokens < 64
        )
    other = remote_config(tmp_path / "b", remote_url=redis_url, remote_prefix=prefix)
    with TieredStore(other) as second:
        covered, _, loaded = second.load_arrays(first, model=TINY)
        assert covered == 64 and loaded.tobytes() == first_kv.tobytes()
        assert second.stats().get("chunk_hits.redis") == 2  # a layer pack per block
