"""KV events for routers (kvstore/events): a real TieredStore, real ZMQ sockets on 127.0.0.1,
and vLLM's own event classes decoding every message where vLLM is installed (ours elsewhere:
tests/kv_events_harness.py).

Skipped without the events extra unless KVSIEVE_REQUIRE_EVENTS=1 (.ci/run); the byte-for-byte
comparison with vLLM's classes is skipped without vLLM unless KVSIEVE_REQUIRE_VLLM=1.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import TINY, corrupt_chunk, extra_installed, kvsieve, make_kv, make_tokens, require_extra

if not extra_installed("events"):
    require_extra("events")  # skips this module, or fails it under KVSIEVE_REQUIRE_EVENTS=1

import msgspec
import zmq
from kv_events_harness import (
    BLOCK,
    DECODER,
    ROUTER,
    VLLM,
    VLLM_CLASSES,
    Published,
    Subscriber,
    close,
    distinct,
    events_config,
    memory_view,
    publish,
    store_view,
)

from bench.common.sidecar import free_port
from kvstore.config import StoreConfig
from kvstore.errors import InvalidInputError
from kvstore.events import hashing, wire
from kvstore.events.config import EventsConfig
from kvstore.events.publisher import Publisher, Sockets, open_publisher
from kvstore.keys import block_keys, namespace_digest
from kvstore.server.config import ServerConfig
from kvstore.server.metrics import EventsCollector
from kvstore.store.tiered import TieredStore

pytestmark = pytest.mark.events


@pytest.fixture
def context() -> Iterator[zmq.Context[Any]]:
    ctx: zmq.Context[Any] = zmq.Context()
    yield ctx
    ctx.destroy(0)


@pytest.fixture
def published(tmp_path: Path, context: zmq.Context[Any]) -> Iterator[Published]:
    store = TieredStore(StoreConfig(data_dir=tmp_path / "data", block_tokens=BLOCK, chunk_tokens=8))
    p = publish(store, context)
    yield p
    close(p)


@pytest.mark.vllm
def test_our_bytes_are_vllms_bytes() -> None:
    """The same events through our classes and vLLM's encode to identical bytes."""
    if VLLM_CLASSES is None:
        if os.environ.get("KVSIEVE_REQUIRE_VLLM") == "1":
            pytest.fail("vLLM is required (KVSIEVE_REQUIRE_VLLM=1) but not installed", pytrace=False)
        pytest.skip("vLLM not installed (pip install -e '.[vllm]')")

    def batch(classes: Any) -> Any:
        stored, removed, cleared, make_batch = classes
        salted = {"extra_keys": [("dynamo-cache-salt:ab",), None]}
        common = {"block_size": 16, "lora_id": None, "lora_name": None}
        return make_batch(ts=1.5, data_parallel_rank=0, events=[
            cleared(),
            stored(block_hashes=[1, 2**64 - 1], parent_block_hash=None, token_ids=[5] * 32, medium="CPU",
                   **common, **salted),
            stored(block_hashes=[3], parent_block_hash=2, token_ids=[6] * 16, medium="STORAGE", **common),
            removed(block_hashes=[1, 3], medium="STORAGE"),
        ])  # fmt: skip

    ours = batch((wire.BlockStored, wire.BlockRemoved, wire.AllBlocksCleared, wire.EventBatch))
    names = ("BlockStored", "BlockRemoved", "AllBlocksCleared", "KVEventBatch")
    theirs = batch(tuple(VLLM[name] for name in names))
    encoder = msgspec.msgpack.Encoder()
    assert encoder.encode(ours) == encoder.encode(theirs)
    assert DECODER.decode(encoder.encode(ours)) == theirs


def test_snapshot_then_stored_blocks_chained_over_router_blocks(published: Published) -> None:
    router = published.router
    assert router.batches >= 1 and not router.held  # the snapshot of an empty store: a clear
    tokens = make_tokens(3 * BLOCK)
    published.store.store(tokens, make_kv(TINY, len(tokens)), model=TINY)
    router.catch_up(published.publisher)
    events = distinct(router.held.values())  # each BlockStored once, in order
    assert [len(e.block_hashes) for e in events] == [BLOCK // ROUTER] * 3
    assert np.array_equal(np.concatenate([e.token_ids for e in events]), tokens)
    assert [e.parent_block_hash for e in events] == [
        None,
        events[0].block_hashes[-1],
        events[1].block_hashes[-1],
    ]
    assert {e.block_size for e in events} == {ROUTER} and {e.medium for e in events} == {"STORAGE"}
    keys = block_keys(tokens, BLOCK, TINY.fingerprint, namespace_digest("default"))
    assert [e.block_hashes[-1] for e in events] == [hashing.key_hash(k) for k in keys]
    assert all(e.extra_keys is None for e in events)  # the default namespace needs no salt
    assert set(router.held) == store_view(published.store)


def test_a_namespace_carries_its_salt_and_its_own_hashes(published: Published) -> None:
    tokens = make_tokens(2 * BLOCK, seed=3)
    for namespace in ("default", "tenant-a"):
        published.store.store(tokens, make_kv(TINY, len(tokens)), model=TINY, namespace=namespace)
    published.router.catch_up(published.publisher)
    events = distinct(published.router.held.values())
    assert len(events) == 4 and len(published.router.held) == 4 * BLOCK // ROUTER  # no hash shared
    salted = [e for e in events if e.extra_keys is not None]
    salt = hashing.namespace_salt("tenant-a")
    assert salt is not None and "tenant-a" not in salt  # the digest, never the tenant's name
    assert [e.extra_keys for e in salted] == [[(hashing.SALT_PREFIX + salt,), None]] * 2
    assert salted[1].parent_block_hash == salted[0].block_hashes[-1]


def test_siblings_share_router_blocks_and_a_shared_one_stays_while_held(published: Published) -> None:
    """Two stored blocks with one parent and equal first 16 tokens share that router block:
    announced once, and still held after one of the two leaves."""
    first = make_tokens(2 * BLOCK, seed=5)
    second = first.copy()
    second[BLOCK + ROUTER :] += 1  # same parent block, same first router block, then different
    for tokens in (first, second):
        published.store.store(tokens, make_kv(TINY, len(tokens)), model=TINY)
    published.router.catch_up(published.publisher)
    events = distinct(published.router.held.values())
    assert [len(e.block_hashes) for e in events] == [2, 2, 1]  # the sibling announces its own part
    assert events[2].parent_block_hash == events[1].block_hashes[0]
    assert events[2].token_ids == second[BLOCK + ROUTER :].tolist()
    keys = block_keys(first, BLOCK, TINY.fingerprint, namespace_digest("default"))
    published.store.index.forget(keys[1])
    published.router.catch_up(published.publisher)
    assert set(published.router.held) == store_view(published.store)
    assert len(published.router.held) == 4  # the parent's two, the shared one, the sibling's own


def test_forgotten_and_corrupt_blocks_are_removed(tmp_path: Path, context: zmq.Context[Any]) -> None:
    config = StoreConfig(data_dir=tmp_path / "data", block_tokens=BLOCK, chunk_tokens=8, memory_bytes=1 << 20)
    a, b = make_tokens(3 * BLOCK, seed=1), make_tokens(3 * BLOCK, seed=2)
    with TieredStore(config) as store:
        for tokens in (a, b):
            store.store(tokens, make_kv(TINY, len(tokens)), model=TINY)
    keys_b = block_keys(b, BLOCK, TINY.fingerprint, namespace_digest("default"))
    corrupt_chunk(config, keys_b[1], TINY.num_layers)  # its layer pack (what a full load reads)
    p = publish(TieredStore(config), context)  # a restarted store: its snapshot lists all six
    try:
        assert len(p.router.held) == 6 * BLOCK // ROUTER
        keys_a = block_keys(a, BLOCK, TINY.fingerprint, namespace_digest("default"))
        p.store.index.forget(keys_a[2])  # dropped as lost
        p.store.load_arrays(b, model=TINY)  # meets the corrupt chunk: the block is quarantined
        assert p.store.stats().get("checksum_failures") == 1
        p.router.catch_up(p.publisher)
        assert p.store.lookup(b, model=TINY).num_tokens == BLOCK  # the corrupt block and its child left
        assert set(p.router.held) == store_view(p.store)
        assert len(p.router.held) == 3 * BLOCK // ROUTER
    finally:
        close(p)


def test_evicted_blocks_are_removed(tmp_path: Path, context: zmq.Context[Any]) -> None:
    """A memory-only store too small for two prefixes evicts the older one's blocks."""
    block_bytes = TINY.token_bytes * BLOCK
    config = StoreConfig(block_tokens=BLOCK, chunk_tokens=8, memory_bytes=int(4.5 * block_bytes))
    p = publish(TieredStore(config), context, medium="CPU")
    try:
        for seed in (1, 2):
            tokens = make_tokens(3 * BLOCK, seed=seed)
            p.store.store(tokens, make_kv(TINY, len(tokens)), model=TINY)
        p.router.catch_up(p.publisher)
        assert p.store.tree.num_blocks < 6  # something was evicted
        assert set(p.router.held) == store_view(p.store)
    finally:
        close(p)


def test_memory_is_a_tier_of_its_own_beside_the_disk(tmp_path: Path, context: zmq.Context[Any]) -> None:
    """Beside a disk tier, memory is a cache: a block held whole in memory is announced on CPU
    too, leaves CPU when memory gives up one of its chunks (disk still holds it), and comes back
    when a load promotes it whole again."""
    block_bytes = TINY.token_bytes * BLOCK
    config = StoreConfig(
        data_dir=tmp_path / "data", block_tokens=BLOCK, chunk_tokens=8, memory_bytes=int(3.5 * block_bytes)
    )
    p = publish(TieredStore(config), context)
    try:
        prefixes = [make_tokens(BLOCK, seed=seed) for seed in range(6)]
        for tokens in prefixes:
            p.store.store(tokens, make_kv(TINY, len(tokens)), model=TINY)
        p.router.catch_up(p.publisher)
        assert len(p.router.held) == 6 * BLOCK // ROUTER  # all on disk
        assert 0 < len(p.router.memory) < len(p.router.held)  # some left memory
        assert set(p.router.held) == store_view(p.store) and set(p.router.memory) == memory_view(p.store)
        assert {e.medium for e in p.router.memory.values()} == {"CPU"}
        first = block_keys(prefixes[0], BLOCK, TINY.fingerprint, namespace_digest("default"))[0]
        assert first not in p.store.keys_in_memory()  # the oldest went first
        p.store.load_arrays(prefixes[0], model=TINY)  # promoted whole again
        p.router.catch_up(p.publisher)
        assert first in p.store.keys_in_memory()
        assert hashing.key_hash(first) in p.router.memory
        assert set(p.router.memory) == memory_view(p.store)
    finally:
        close(p)


def test_many_stores_gap_free_and_equal_to_the_store(published: Published) -> None:
    for seed in range(200):
        tokens = make_tokens(2 * BLOCK, seed=seed)
        published.store.store(tokens, make_kv(TINY, len(tokens)), model=TINY)
    published.router.catch_up(published.publisher)
    assert published.router.gaps == 0
    assert published.publisher.stats().dropped == 0
    assert set(published.router.held) == store_view(published.store)
    assert set(published.router.memory) == memory_view(published.store)


def test_a_subscriber_that_never_reads_blocks_nothing(tmp_path: Path) -> None:
    """Over inproc (no kernel buffers between the sockets) with high-water marks of 4 messages, a
    subscriber that never reads overflows at once and ZMQ drops its messages; every store still
    completes, and a router that read late lost batches too, saw the gaps and recovered its view
    through the replay socket."""
    store = TieredStore(StoreConfig(data_dir=tmp_path / "data", block_tokens=BLOCK, chunk_tokens=8))
    config = EventsConfig(
        "inproc://kv-events", f"tcp://127.0.0.1:{free_port()}", heartbeat_s=0.05, high_water_mark=4
    )
    publisher = open_publisher(config, BLOCK, store)
    shared = publisher._sockets.context  # inproc reaches only sockets of the publisher's context
    stalled = shared.socket(zmq.SUB)
    stalled.setsockopt(zmq.RCVHWM, 1)
    stalled.setsockopt(zmq.SUBSCRIBE, b"")
    stalled.connect(config.endpoint)
    router = Subscriber(shared, config.endpoint, config.replay_endpoint, medium="CPU", receive_hwm=4)
    router.catch_up(publisher)
    p = Published(store, publisher, router)
    try:
        for seed in range(100):
            tokens = make_tokens(BLOCK, seed=seed)
            store.store(tokens, make_kv(TINY, len(tokens)), model=TINY)
            time.sleep(0.01)  # batches go out one by one, far more than the marks hold
        router.catch_up(publisher)
        assert store.tree.num_blocks == 100
        assert router.gaps > 0  # the late reader's messages were dropped: the mark is real
        assert set(router.held) == store_view(store)
        received = 0
        while stalled.poll(0):
            stalled.recv_multipart()
            received += 1
        assert received <= 4 + 1  # what its queues held; everything else was dropped, not waited for
    finally:
        stalled.close(0)
        close(p)


def test_a_full_queue_drops_news_counts_it_and_resyncs(tmp_path: Path, context: zmq.Context[Any]) -> None:
    store = TieredStore(StoreConfig(data_dir=tmp_path / "data", block_tokens=BLOCK, chunk_tokens=8))
    config = events_config(queue_size=2)
    publisher = Publisher(config, Sockets.open(config, zmq), store=store)
    snapshot = store.watch(publisher)  # not started yet: nothing drains the queue
    for seed in range(5):
        tokens = make_tokens(BLOCK, seed=seed)
        store.store(tokens, make_kv(TINY, len(tokens)), model=TINY)
    assert publisher.stats().dropped == 8  # each store brings two news (whole in memory, listed)
    metrics = {m.name: m.samples[0].value for m in EventsCollector(publisher).collect()}
    assert metrics["kvsieve_kv_events_dropped"] == 8
    publisher.start(snapshot, store.keys_in_memory())
    router = Subscriber(context, config.endpoint, config.replay_endpoint)
    p = Published(store, publisher, router)
    try:
        router.catch_up(publisher)
        assert publisher.stats().resyncs == 1
        assert set(router.held) == store_view(store) and len(router.held) == 5 * BLOCK // ROUTER
    finally:
        close(p)


def test_replay_answers_from_its_buffer_and_a_snapshot_for_a_sequence_long_gone(
    tmp_path: Path, context: zmq.Context[Any]
) -> None:
    store = TieredStore(StoreConfig(data_dir=tmp_path / "data", block_tokens=BLOCK, chunk_tokens=8))
    p = publish(store, context, replay_batches=4)
    try:
        for seed in range(6):
            tokens = make_tokens(BLOCK, seed=seed)
            store.store(tokens, make_kv(TINY, len(tokens)), model=TINY)
        assert store.flush(30)  # the disk's news (behind its group commit) published before the replay
        p.router.catch_up(p.publisher)
        last = p.publisher.stats().last_seq
        recent = [seq for seq, _ in p.router.replay(last - 1)]  # heartbeats may follow
        assert recent == list(range(last - 1, last - 1 + len(recent))) and len(recent) >= 2
        gone = p.router.replay(0)  # long before the buffer: one snapshot, numbered as the newest
        assert gone[0][0] >= last  # then only the heartbeats published while it was answered
        assert all(not batch.events for _, batch in gone[1:])
        assert [seq for seq, _ in gone] == list(range(gone[0][0], gone[0][0] + len(gone)))
        events = gone[0][1].events
        assert isinstance(events[0], VLLM["AllBlocksCleared"]) and len(events) == 1 + 6 + 6  # disk, memory
        assert p.router.replay(2**63) == []  # nothing that new: the end marker alone
        dealer = context.socket(zmq.DEALER)
        dealer.connect(p.publisher.config.replay_endpoint)
        dealer.send_multipart([b"", b"short"])  # malformed: answered with the end marker, not a hang
        assert dealer.poll(10_000)
        assert dealer.recv_multipart()[-2:] == [wire.END_SEQ, b""]
        dealer.close(0)
        assert set(p.router.held) == store_view(store)
    finally:
        close(p)


def test_bad_endpoints_are_refused_at_start(tmp_path: Path) -> None:
    with pytest.raises(InvalidInputError, match="must start with"):
        ServerConfig(kv_events="udp://127.0.0.1:5557")
    with pytest.raises(InvalidInputError, match="carry every tenant's token ids"):
        ServerConfig(kv_events="tcp://*:5557")
    with pytest.raises(InvalidInputError, match="needs kv_events"):
        ServerConfig(kv_events_replay="tcp://127.0.0.1:5558")
    with pytest.raises(InvalidInputError, match="must divide"):
        EventsConfig("tcp://127.0.0.1:5557", router_block_tokens=24).check_block_tokens(256)
    taken = zmq.Context.instance().socket(zmq.PUB)
    port = taken.bind_to_random_port("tcp://127.0.0.1")
    try:
        with TieredStore(StoreConfig(block_tokens=BLOCK, chunk_tokens=8, memory_bytes=1 << 20)) as store:
            with pytest.raises(InvalidInputError, match="cannot bind"):
                open_publisher(EventsConfig(f"tcp://127.0.0.1:{port}"), BLOCK, store)
            assert store.index._listener is None  # nothing was subscribed
        serve = ["serve", "--data-dir", str(tmp_path / "d"), "--listen", "127.0.0.1:0"]
        serve += ["--metrics-listen", ""]
        result = kvsieve(*serve, "--kv-events", f"tcp://127.0.0.1:{port}", timeout=60)
        assert result.returncode == 2
        assert "kv_events endpoint: cannot bind" in result.stderr
        assert "Address already in use" in result.stderr
    finally:
        taken.close(0)


def test_without_pyzmq_kv_events_says_what_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "zmq", None)  # as if pyzmq were not installed
    config = StoreConfig(block_tokens=BLOCK, chunk_tokens=8, memory_bytes=1 << 20)
    with TieredStore(config) as store, pytest.raises(InvalidInputError, match=r"kvsieve\[events\]"):
        open_publisher(EventsConfig("tcp://127.0.0.1:1"), BLOCK, store)


def test_sequence_of_a_restarted_publisher_starts_above_the_last(published: Published) -> None:
    """Routers drop batches numbered below one they saw: a new run must start higher."""
    first = published.publisher.stats().last_seq
    time.sleep(0.001)
    config = events_config()
    again = Publisher(config, Sockets.open(config, zmq), store=published.store)
    assert again.stats().last_seq >= first
    again.close()  # never started: closes its sockets


def test_llm_d_style_the_sidecar_connects_to_a_subscriber_that_binds(
    tmp_path: Path, context: zmq.Context[Any]
) -> None:
    """llm-d's indexer binds and filters on the topic `kv@<pod>@<model>`: the publisher connects."""
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    config = EventsConfig(f"tcp://127.0.0.1:{port}", topic="kv@pod-1@tiny", connect=True, heartbeat_s=0.05)
    with TieredStore(StoreConfig(block_tokens=BLOCK, chunk_tokens=8, memory_bytes=1 << 20)) as store:
        publisher = open_publisher(config, BLOCK, store)
        try:
            # A PUB drops what it sends before its connection is up (llm-d has no replay): store
            # once a first batch (the snapshot or a heartbeat) has arrived
            assert sub.poll(10_000), "nothing arrived on the subscriber's bound socket"
            tokens = make_tokens(BLOCK, seed=4)
            store.store(tokens, make_kv(TINY, len(tokens)), model=TINY)
            stored = None
            deadline = time.monotonic() + 30
            while stored is None:
                assert time.monotonic() < deadline, "the stored block was never published"
                assert sub.poll(10_000), "nothing arrived on the subscriber's bound socket"
                topic, _seq, payload = sub.recv_multipart()
                assert topic == b"kv@pod-1@tiny"
                events = DECODER.decode(payload).events
                stored = next((e for e in events if isinstance(e, VLLM["BlockStored"])), None)
            assert stored.token_ids == tokens.tolist() and stored.medium == "CPU"
        finally:
            store.watch(None)
            publisher.close()
            sub.close(0)
