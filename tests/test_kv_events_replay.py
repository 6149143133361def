"""The replay socket under a flood (kvstore/events/replay.py, history.py): real ZMQ clients that
ask for sequence 0 as fast as they can against a real publisher on a real store, and against a
real `kvsieve serve`. What is asserted is the bound's behaviour (the end marker, the counters,
one snapshot shared per state), never a time: the cost of a flood to stores is measured by
`kvsieve bench events` (store_p50_replay_flood_vs_quiet)."""

from __future__ import annotations

import contextlib
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import TINY, extra_installed, make_kv, make_tokens, require_extra

if not extra_installed("events"):
    require_extra("events")  # skips this module, or fails it under KVSIEVE_REQUIRE_EVENTS=1

import zmq
from kv_events_harness import BLOCK, DECODER, VLLM, Published, Subscriber, close, publish, store_view

from bench.common.sidecar import Sidecar, free_port
from kvstore.client.kvclient import KVClient
from kvstore.config import StoreConfig
from kvstore.events import wire
from kvstore.events.history import TAIL_MAX, History
from kvstore.server.metrics import EventsCollector
from kvstore.store.tiered import TieredStore

pytestmark = pytest.mark.events
Answer = list[tuple[int, bytes]]  # the batches of one answer, before its end marker


@pytest.fixture
def context() -> Iterator[zmq.Context[Any]]:
    ctx: zmq.Context[Any] = zmq.Context()
    yield ctx
    ctx.destroy(0)


def stored(context: zmq.Context[Any], prefixes: int = 3, **bounds: Any) -> Published:
    """A memory-only store holding `prefixes` prefixes of two blocks, published with `bounds`."""
    store = TieredStore(StoreConfig(block_tokens=BLOCK, chunk_tokens=8, memory_bytes=1 << 24))
    p = publish(store, context, medium="CPU", **bounds)
    for seed in range(prefixes):
        tokens = make_tokens(2 * BLOCK, seed=seed)
        store.store(tokens, make_kv(TINY, len(tokens)), model=TINY)
    p.router.catch_up(p.publisher)
    return p


def flood(dealer: Any, requests: int, start: int = 0) -> None:
    """Ask for `start` `requests` times, as fast as the socket takes them, reading nothing."""
    for _ in range(requests):
        dealer.send_multipart([b"", wire.encode_seq(start)])


def answers(dealer: Any, count: int) -> list[Answer]:
    """Read until `count` end markers came; each answer's batches (empty: the end marker alone)."""
    got: list[Answer] = []
    current: Answer = []
    while len(got) < count:
        assert dealer.poll(20_000), f"only {len(got)} of {count} replay requests were answered"
        frames = dealer.recv_multipart()
        if frames[-2:] == [wire.END_SEQ, b""]:
            got.append(current)
            current = []
        else:
            current.append((wire.decode_seq(frames[2]), frames[3]))
    return got


def dealer_on(context: zmq.Context[Any], endpoint: str) -> Any:
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    return dealer


# -- the history: buffered answers, one snapshot per state, its building budget -------------


def test_history_answers_from_its_buffer_and_else_from_one_shared_snapshot() -> None:
    built: list[int] = []

    def build() -> bytes:
        built.append(history.last)
        return b"snapshot"

    history = History(keep=TAIL_MAX * 2, build=build)
    for seq in range(100, 100 + TAIL_MAX + 10):
        history.append(seq, b"batch %d" % seq)
    last = history.last
    assert history.answer(last + 1) == []  # nothing that new
    assert [seq for seq, _ in history.answer(last - 2)] == [last - 2, last - 1, last]  # buffered
    old = history.answer(0)  # long gone: a snapshot numbered as the newest, nothing after it
    assert old == [(last, b"snapshot")] and built == [last]
    far = history.answer(100)  # kept, but more than TAIL_MAX back: the same snapshot, not built again
    assert far == old and len(built) == 1
    history.append(last + 1, b"next")
    assert history.answer(0) == [*old, (last + 1, b"next")]  # the snapshot, then what came after it
    assert len(built) == 1 and history.builds == 1


def test_history_builds_a_new_snapshot_when_its_tail_is_long_and_only_within_its_budget() -> None:
    now = [0.0]

    def build() -> bytes:
        now[0] += 0.01  # each build takes 10 ms of this clock
        return b"snapshot at %d" % history.last

    history = History(keep=TAIL_MAX * 4, build=build, clock=lambda: now[0])
    history.append(0, b"first snapshot", is_snapshot=True)  # a published snapshot is used as it is
    assert history.answer(0) == [(0, b"first snapshot")] and history.builds == 0
    for seq in range(1, TAIL_MAX + 1):  # the published snapshot is now TAIL_MAX batches old
        history.append(seq, b"batch")
    answer = history.answer(0)
    assert answer == [(TAIL_MAX, b"snapshot at %d" % TAIL_MAX)] and history.builds == 1
    for seq in range(TAIL_MAX + 1, 2 * TAIL_MAX + 1):
        history.append(seq, b"batch")
    assert history.answer(0) is None  # stale, and a build now would pass the budget
    now[0] += 0.01 * 19  # 19 times the last build's time later
    rebuilt = history.answer(0)
    assert rebuilt is not None and rebuilt[0] == (2 * TAIL_MAX, b"snapshot at %d" % (2 * TAIL_MAX))
    assert history.builds == 2


# -- a real publisher on a real store --------------------------------------------------------


def test_a_flood_from_one_client_gets_the_end_marker_past_its_bound_and_is_counted(
    context: zmq.Context[Any],
) -> None:
    p = stored(context, replay_client_burst=3, replay_client_rate=0.5, replay_batches=4)
    try:
        before = p.publisher.stats()
        dealer = dealer_on(context, p.publisher.config.replay_endpoint)
        began = time.monotonic()
        flood(dealer, 200)
        got = answers(dealer, 200)
        elapsed = time.monotonic() - began
        full = [answer for answer in got if answer]
        assert 3 <= len(full) <= 3 + 0.5 * elapsed + 1  # the burst, then at most the rate
        stats = p.publisher.stats()
        refused = stats.replays_refused - before.replays_refused
        assert refused == len(got) - len(full) and stats.replays - before.replays == 200
        metrics = {m.name: m.samples[0].value for m in EventsCollector(p.publisher).collect()}
        assert metrics["kvsieve_kv_events_replays_refused"] == stats.replays_refused
        # the buffer (4 batches) is long past 0: every full answer is the same snapshot, built once
        assert len({answer[0][1] for answer in full}) == 1 and stats.snapshots - before.snapshots <= 1
        view = Subscriber(context, p.publisher.config.endpoint, "", medium="CPU")
        for seq, payload in full[0]:
            view.apply(seq, payload)
        assert isinstance(DECODER.decode(full[0][0][1]).events[0], VLLM["AllBlocksCleared"])
        assert set(view.held) == store_view(p.store)  # the whole truth
        view.close()
        other = dealer_on(context, p.publisher.config.replay_endpoint)  # its own allowance
        flood(other, 1)
        assert answers(other, 1)[0], "another client is not bound by the first one's flood"
        dealer.close(0)
        other.close(0)
    finally:
        close(p)


def test_the_bound_in_all_holds_across_clients(context: zmq.Context[Any]) -> None:
    p = stored(context, replay_total_burst=4, replay_total_rate=0.5)
    try:
        before = p.publisher.stats().replays_refused
        dealers = [dealer_on(context, p.publisher.config.replay_endpoint) for _ in range(12)]
        began = time.monotonic()
        for dealer in dealers:  # a client each: no client is over its own bound
            flood(dealer, 1)
        got = [answers(dealer, 1)[0] for dealer in dealers]
        elapsed = time.monotonic() - began
        full = sum(1 for answer in got if answer)
        assert 1 <= full <= 4 + 0.5 * elapsed + 1
        assert p.publisher.stats().replays_refused - before == len(dealers) - full
        for dealer in dealers:
            dealer.close(0)
    finally:
        close(p)


def test_stores_during_a_flood_are_all_published_and_nothing_is_left_behind(
    context: zmq.Context[Any],
) -> None:
    """A client floods the replay socket and never reads while 40 prefixes are stored: every
    store completes, the router's view equals the store's, nothing stays queued after it."""
    p = stored(context, prefixes=1)
    stop = threading.Event()
    flooder = dealer_on(context, p.publisher.config.replay_endpoint)
    flooder.setsockopt(zmq.SNDTIMEO, 100)  # ZMQ's marks stop a client that sends faster

    def run() -> None:
        while not stop.is_set():
            with contextlib.suppress(zmq.Again):
                flood(flooder, 1)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        for seed in range(100, 140):
            tokens = make_tokens(2 * BLOCK, seed=seed)
            p.store.store(tokens, make_kv(TINY, len(tokens)), model=TINY)
        p.router.catch_up(p.publisher)
        assert set(p.router.held) == store_view(p.store) and len(p.router.held) == 41 * 2 * BLOCK // 16
        stats = p.publisher.stats()
        assert stats.replays_refused > 0 and stats.queued == 0 and stats.dropped == 0
    finally:
        stop.set()
        thread.join(10)
        flooder.close(0)
        close(p)


# -- a real sidecar ----------------------------------------------------------------------


@pytest.mark.slow
def test_a_sidecar_bounds_a_flood_and_reports_it_in_its_metrics(tmp_path: Path) -> None:
    endpoint, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    args = ["--kv-events", endpoint, "--kv-events-replay", replay, "--kv-events-heartbeat-s", "0.05"]
    sidecar = Sidecar(tmp_path / "data", args=args).start()
    context: zmq.Context[Any] = zmq.Context()
    try:
        with KVClient(sidecar.address) as client:
            tokens = make_tokens(2 * 32, seed=7)
            client.store(tokens, make_kv(TINY, len(tokens)), model=TINY)
            dealer = dealer_on(context, replay)
            flood(dealer, 300)
            got = answers(dealer, 300)
            client.store(make_tokens(32, seed=8), make_kv(TINY, 32), model=TINY)  # still served
        full = sum(1 for answer in got if answer)
        assert 1 <= full < 300  # the default bound: a burst of 4, then 2 a second
        page = urllib.request.urlopen(f"http://127.0.0.1:{sidecar.metrics_port}/metrics", timeout=10)
        metrics = dict(
            line.rsplit(" ", 1)
            for line in page.read().decode().splitlines()
            if line.startswith("kvsieve_kv_")
        )
        assert float(metrics["kvsieve_kv_events_replays_refused_total"]) == 300 - full
        assert float(metrics["kvsieve_kv_events_replays_total"]) >= 300
        dealer.close(0)
    finally:
        context.destroy(0)
        sidecar.kill()
