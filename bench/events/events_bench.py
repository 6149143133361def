"""`kvsieve bench events`: KV events for routers, read by a real Dynamo indexer.

In one run, on loopback (blocks of 256 tokens published as router blocks of 16):

- `indexer_matched_fraction`: a `kvsieve serve --kv-events` and Dynamo's standalone indexer
  (bench/events/setup_dynamo.sh) subscribed to it; 200 prefixes of two blocks (50 with --quick) stored
  through KVClient; tokens the indexer's `/query` reports matched / tokens stored. Target 1.0.
- `event_lag_p99_ms`: per store, from the acknowledged Store to the first `/query` that reports
  the whole prefix (queried back to back; each query is one HTTP round trip). Target <= 50 ms.
- `stale_after_removal`: a tenth of the prefixes lose their second block (a corrupt chunk met by
  a load quarantines it); router blocks the indexer still reports beyond what the store
  holds, summed over all prefixes, once it had 5 s to hear of it. Target 0.
- `restart_view_equal`: after a sidecar restart (a block removed while it was down) and after
  an indexer restart, the indexer's match equals the store's lookup for every prefix. Target true.
- `events_lost`: an embedded store with a publisher, 10,000 stores (2,000 with --quick), a
  subscriber in a thread that keeps up: sequence gaps it saw. Target 0.
- `store_throughput_events_vs_off`: stores per second of an embedded memory-only store with
  events on / off (two equal stores, one publishing), rounds alternated on-off-off-on after two
  warm-up rounds, medians compared.
  The harshest case on purpose: no disk commit and a tiny KV (8 KB per 256-token block, the
  importance layout: a layered store's key summaries cost it ~10x more time), so the per-store
  cost of events weighs the most it can. Target >= 0.97.
  `store_throughput_events_vs_off_disk`: the same with both stores on LMDB (a disk commit per
  store, as a sidecar with --data-dir does).
- `store_p50_replay_flood_vs_quiet`: a `kvsieve serve --kv-events` holding 400 blocks (100 with
  --quick); the median Store latency (one block, through KVClient) while a local client asks
  the replay socket for sequence 0 as fast as its socket takes requests and never reads the
  answers, over the median before it started. Measured once the flooder's socket stopped taking
  requests (ZMQ's and the kernel's queues full: before that, for about 2 s, the flooder burns a
  core of its own filling them, which no server can refuse). Target <= 1.2.
  `store_p50_after_replay_flood_vs_quiet`: the same right after the flooder was killed.
  `replay_flood_refused`: requests the sidecar answered with the end marker alone.

Without the Dynamo venv the indexer figures are absent and `dynamo_unavailable` says why.
"""

from __future__ import annotations

import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.common.sidecar import Sidecar, free_port
from bench.events.dynamo_indexer import DynamoIndexer, dynamo_python
from bench.events.flood import replay_flood
from kvstore.client.kvclient import KVClient
from kvstore.config import StoreConfig
from kvstore.events.config import EventsConfig
from kvstore.events.publisher import LINGER_MAX_S, Publisher, open_publisher
from kvstore.keys import block_keys, namespace_digest
from kvstore.model import ModelSpec
from kvstore.store.tiered import TieredStore

MODEL = ModelSpec("bench-events", num_layers=2, num_kv_heads=2, head_dim=8)
BLOCK = 256
ROUTER = 16


def run(quick: bool = False) -> dict[str, Any]:
    """Run the benchmark; returns the JSON object `kvsieve bench events --json` prints."""
    out: dict[str, Any] = {"block_tokens": BLOCK, "router_block_tokens": ROUTER}
    with tempfile.TemporaryDirectory(dir=Path.home()) as tmp:
        out |= _lost_and_throughput(Path(tmp), 2_000 if quick else 10_000, 200 if quick else 500)
        out |= replay_flood(Path(tmp) / "flood", 100 if quick else 400, 40 if quick else 200)
        python = dynamo_python()
        if python is None:
            out["dynamo_unavailable"] = "no Dynamo venv: bash bench/events/setup_dynamo.sh"
        else:
            out |= _with_dynamo(Path(tmp), python, 50 if quick else 200)
    return out


# -- against a real sidecar and a real Dynamo indexer --------------------------------------


def _with_dynamo(tmp: Path, python: Path, num_prefixes: int) -> dict[str, Any]:
    endpoint, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    args = ["--block-tokens", str(BLOCK), "--chunk-tokens", "16", "--kv-events", endpoint]
    args += ["--kv-events-replay", replay, "--kv-events-heartbeat-s", "0.5"]
    sidecar = Sidecar(tmp / "sidecar", args=args).start()
    indexer = DynamoIndexer(python, tmp / "indexer.log").start()
    try:
        indexer.register(1, endpoint, replay, ROUTER)
        rng = np.random.default_rng(0)
        prefixes = [rng.integers(0, 50_000, 2 * BLOCK).tolist() for _ in range(num_prefixes)]
        out = _stored_and_lag(sidecar, indexer, prefixes)
        out["stale_after_removal"] = _stale_after_removal(sidecar, indexer, prefixes)
        out["restart_view_equal"] = _restarts(sidecar, indexer, prefixes, endpoint, replay)
        return out
    finally:
        indexer.stop()
        sidecar.kill()


def _stored_and_lag(sidecar: Sidecar, indexer: DynamoIndexer, prefixes: list[list[int]]) -> dict[str, Any]:
    kv = np.random.default_rng(1).standard_normal(MODEL.kv_shape(2 * BLOCK)).astype(MODEL.np_dtype)
    lags = []
    with KVClient(sidecar.address) as client:
        for tokens in prefixes:
            client.store(tokens, kv, model=MODEL)
            acknowledged = time.perf_counter()
            indexer.wait_matched(tokens, len(tokens), timeout_s=5)
            lags.append(time.perf_counter() - acknowledged)
    matched = sum(indexer.matched(tokens) for tokens in prefixes)
    return {
        "indexer_matched_fraction": round(matched / sum(len(t) for t in prefixes), 4),
        "event_lag_p50_ms": round(1000 * statistics.median(lags), 2),
        "event_lag_p99_ms": round(1000 * float(np.percentile(lags, 99)), 2),
        "prefixes": len(prefixes),
    }


def _stale_after_removal(sidecar: Sidecar, indexer: DynamoIndexer, prefixes: list[list[int]]) -> int:
    victims = prefixes[:: max(1, len(prefixes) // 10)]
    config = StoreConfig(data_dir=sidecar.data_dir)
    with KVClient(sidecar.address) as client:
        for tokens in victims:
            _corrupt_first_chunk(config, _keys(tokens)[1])
        sidecar.kill()  # memory held the chunks: restart so that loads read the damaged disk copy
        sidecar.proc = None
        sidecar.start()
        for tokens in victims:
            client.load_arrays(tokens, model=MODEL)
        return _excess_router_blocks(client, indexer, prefixes)


def _excess_router_blocks(client: KVClient, indexer: DynamoIndexer, prefixes: list[list[int]]) -> int:
    """Router blocks the indexer reports beyond the store's own lookup, once it had time to hear."""
    excess = 0
    for tokens in prefixes:
        held = client.lookup(tokens, model=MODEL).num_tokens
        excess += max(0, indexer.wait_matched(tokens, held, timeout_s=5) - held) // ROUTER
    return excess


def _restarts(
    sidecar: Sidecar, indexer: DynamoIndexer, prefixes: list[list[int]], endpoint: str, replay: str
) -> bool:
    sidecar.kill()
    config = StoreConfig(data_dir=sidecar.data_dir, block_tokens=BLOCK, chunk_tokens=16)
    with TieredStore(config) as store:  # a block leaves while the sidecar is down
        store.index.forget(_keys(prefixes[-1])[1])
    sidecar.proc = None
    sidecar.start()
    equal_after_sidecar = _view_equal(sidecar, indexer, prefixes)
    indexer.stop()
    indexer.start()
    indexer.register(1, endpoint, replay, ROUTER)
    return equal_after_sidecar and _view_equal(sidecar, indexer, prefixes)


def _view_equal(sidecar: Sidecar, indexer: DynamoIndexer, prefixes: list[list[int]]) -> bool:
    with KVClient(sidecar.address) as client:
        return _excess_router_blocks(client, indexer, prefixes) == 0 and all(
            indexer.wait_matched(t, held := client.lookup(t, model=MODEL).num_tokens, timeout_s=5) == held
            for t in prefixes
        )


def _corrupt_first_chunk(config: StoreConfig, block_key: bytes) -> None:
    """Flip a byte of a block's first chunk on disk, with LMDB itself (the sidecar keeps running)."""
    import lmdb

    from kvstore.format.block_meta import BlockMeta
    from kvstore.keys import chunk_key

    env = lmdb.open(str(config.lmdb_dir), max_dbs=4, map_size=1 << 34)
    with env.begin(write=True) as txn:
        record = txn.get(block_key, db=env.open_db(b"blocks", txn=txn))
        if record is None:
            raise RuntimeError(f"block {block_key.hex()} is not on disk")
        chunks = env.open_db(b"chunks", txn=txn)
        key = chunk_key(block_key, BlockMeta.from_bytes(record).layout_version, 0)
        chunk = txn.get(key, db=chunks)
        if chunk is None:
            raise RuntimeError(f"chunk 0 of block {block_key.hex()} is not on disk")
        data = bytearray(chunk)
        data[len(data) // 2] ^= 0x01
        txn.put(key, bytes(data), db=chunks)
    env.close()


def _keys(tokens: list[int]) -> list[bytes]:
    return block_keys(np.asarray(tokens), BLOCK, MODEL.fingerprint, namespace_digest("default"))


# -- embedded: sequence gaps and the cost of events on stores -----------------------------


def _memory_store(data_dir: Path | None = None) -> TieredStore:
    """A store (memory-only unless `data_dir`) large enough never to evict here (eviction would
    dominate the time)."""
    config = StoreConfig(
        data_dir=data_dir, block_tokens=BLOCK, chunk_tokens=16, memory_bytes=1 << 30, layout="importance"
    )
    return TieredStore(config)


def _lost_and_throughput(tmp: Path, num_stores: int, per_round: int) -> dict[str, Any]:
    disk = _throughput(per_round // 2, tmp)
    return {
        "events_lost": _events_lost(num_stores),
        "stores_for_events_lost": num_stores,
        **_throughput(per_round),
        "store_throughput_events_vs_off_disk": disk["store_throughput_events_vs_off"],
    }


class _GapCounter(threading.Thread):
    """A subscriber that keeps up: counts sequence gaps until told the last sequence number."""

    def __init__(self, endpoint: str) -> None:
        super().__init__(daemon=True)
        import zmq

        self.context = zmq.Context()
        self.sub = self.context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.RCVHWM, 0)  # this reader's own queue never drops: it measures ours
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(endpoint)
        self.last_seq: int | None = None
        self.gaps = 0
        self.until: int | None = None

    def run(self) -> None:
        while self.until is None or self.last_seq is None or self.last_seq < self.until:
            if not self.sub.poll(100):
                continue
            seq = int.from_bytes(self.sub.recv_multipart()[1], "big")
            if self.last_seq is not None and seq != self.last_seq + 1:
                self.gaps += seq - self.last_seq - 1
            self.last_seq = seq
        self.sub.close(0)
        self.context.term()


def _events_lost(num_stores: int) -> int:
    kv = np.zeros(MODEL.kv_shape(BLOCK), MODEL.np_dtype)
    rng = np.random.default_rng(2)
    with _memory_store() as store:
        events = EventsConfig(f"tcp://127.0.0.1:{free_port()}", heartbeat_s=0.05, medium="STORAGE")
        publisher = open_publisher(events, BLOCK, store)
        counter = _GapCounter(events.endpoint)
        counter.start()
        deadline = time.monotonic() + 30
        while counter.last_seq is None and time.monotonic() < deadline:  # heartbeats: it is connected
            time.sleep(0.01)
        for _ in range(num_stores):
            store.store(rng.integers(0, 50_000, BLOCK), kv, model=MODEL)
        while publisher.stats().queued:
            time.sleep(0.01)
        counter.until = publisher.stats().last_seq + 1
        counter.join(30)
        store.watch(None)
        publisher.close()
    if counter.is_alive():
        raise RuntimeError("the subscriber never saw the last batch")
    return counter.gaps


def _throughput(per_round: int, tmp: Path | None = None, pairs: int = 8) -> dict[str, Any]:
    """Two equal stores side by side (memory-only, or on LMDB under `tmp`), one publishing
    (opened once, as a sidecar does); pairs of rounds, one on each, in alternating order after
    a warm-up pair. Between rounds, untimed, the publisher drains its inbox and the disk its
    backlog, so that no round pays for another's. The figure is the median over pairs of on / off:
    a pair's two rounds share the machine's load of the moment (others' jobs on these cores)."""
    kv = np.zeros(MODEL.kv_shape(BLOCK), MODEL.np_dtype)
    rng = np.random.default_rng(3)
    rates: dict[bool, list[float]] = {False: [], True: []}
    dirs = (None, None) if tmp is None else (tmp / "off", tmp / "on")
    with _memory_store(dirs[0]) as off_store, _memory_store(dirs[1]) as on_store:
        publisher = open_publisher(EventsConfig(f"tcp://127.0.0.1:{free_port()}"), BLOCK, on_store)
        for pair in range(pairs + 1):
            for events_on in (True, False) if pair % 2 else (False, True):
                store = on_store if events_on else off_store
                token_lists = [rng.integers(0, 50_000, BLOCK) for _ in range(per_round)]
                start = time.perf_counter()
                for tokens in token_lists:
                    store.store(tokens, kv, model=MODEL)
                if pair:  # the first pair warms up (allocations, caches): not counted
                    rates[events_on].append(per_round / (time.perf_counter() - start))
                _settle(store, publisher)
        on_store.watch(None)
        publisher.close()
    ratios = [on / off for on, off in zip(rates[True], rates[False], strict=True)]
    return {
        "stores_per_s_events_on": round(statistics.median(rates[True]), 1),
        "stores_per_s_events_off": round(statistics.median(rates[False]), 1),
        "store_throughput_events_vs_off": round(statistics.median(ratios), 3),
    }


def _settle(store: TieredStore, publisher: Publisher) -> None:
    """Wait for the disk's backlog and the publisher's inbox, and for its last batch to go out."""
    store.flush()
    while publisher.stats().queued:
        time.sleep(0.002)
    time.sleep(2 * LINGER_MAX_S)
