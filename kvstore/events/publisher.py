"""The KV-event publisher: store threads queue news, one thread publishes it over ZMQ.

Never in the way of a store or a load: the store's threads only put a reference on a bounded
queue (`put_nowait`); when it is full the news is dropped and counted, and the publisher
publishes a fresh snapshot (`AllBlocksCleared`, then every block) once it has caught up, so a
subscriber's view is right again. The PUB socket drops messages for a subscriber that does not
read past its high-water mark (ZMQ's own rule), so a stalled subscriber costs nothing either.

What a subscriber sees:

- sequence numbers without gaps within a run; a run starts at the microseconds since the epoch,
  so a restarted sidecar continues above where it was (a router drops a batch whose sequence
  number is below one it has seen) and the jump tells it to ask for a replay;
- first an `AllBlocksCleared` and a `BlockStored` for every listed block (the snapshot);
- then a `BlockStored` per newly listed block and a `BlockRemoved` per unlisted one; and an
  empty batch after `heartbeat_s` without news, so a router that (re)started late notices the
  sequence it missed at once and asks for a replay;
- on the replay socket, the batches from the asked sequence on, from a buffer of the last
  `replay_batches`; a sequence older than the buffer is answered with a snapshot (one batch
  starting with `AllBlocksCleared`, numbered as the newest published batch), never a hang.

What was announced is kept by a `RouterView` (kvstore/events/view.py: references to the blocks'
metadata, no copy), which this thread alone touches: a snapshot it sends is exact at the
sequence number it carries.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from kvstore.errors import InvalidInputError
from kvstore.events.config import EventsConfig
from kvstore.format.block_meta import BlockMeta

if TYPE_CHECKING:
    import zmq

    from kvstore.events import wire

log = logging.getLogger(__name__)
# In a burst (news within BURST_GAP_S of the last batch) the first news waits LINGER_S for more,
# so that a burst of stores is one batch: waking this thread once per store made it fight the
# storing threads for the GIL (measured: 0.6 of the store rate without events, 0.84 with the
# linger). Outside a burst it is published at once (a sleep costs ~20 ms of lag in a busy sidecar).
LINGER_S = 0.005
BURST_GAP_S = 0.002


@dataclass(frozen=True)
class PublisherStats:
    """What the publisher did since it started (counters) and where it is (last_seq, queued)."""

    batches: int
    events: int
    dropped: int
    resyncs: int
    replays: int
    queued: int
    last_seq: int


class WatchedStore(Protocol):
    """What the publisher needs of a store (kvstore.store.tiered.TieredStore has it)."""

    def watch(self, listener: Any) -> list[BlockMeta]:
        """Tell `listener` of every change from now on; return the blocks listed now, parents first."""
        ...

    def listed_blocks(self) -> list[BlockMeta]:
        """The blocks listed now, parents first."""
        ...

    def keys_in_memory(self) -> set[bytes]:
        """The blocks held whole in a memory tier that caches a durable one."""
        ...


def open_publisher(config: EventsConfig, block_tokens: int, store: WatchedStore) -> Publisher:
    """Bind (or connect) the sockets, subscribe to `store` and start publishing from its
    snapshot. Stop with `store.watch(None)`, then `Publisher.close()`.

    Raises:
        InvalidInputError: pyzmq or msgspec missing, a bad endpoint, an address in use, or a
            router block size that does not divide `block_tokens`.
    """
    config.check_block_tokens(block_tokens)
    try:
        import msgspec  # noqa: F401  # imported here so that kvstore runs without the events extra
        import zmq
    except ImportError as exc:
        raise InvalidInputError(
            f"--kv-events needs pyzmq and msgspec ({exc.name} is missing): pip install 'kvsieve[events]'"
        ) from exc
    publisher = Publisher(config, Sockets.open(config, zmq), store=store)
    listed = store.watch(publisher)
    publisher.start(listed, store.keys_in_memory())
    return publisher


class Sockets:
    """The PUB socket and the optional ROUTER socket for replay, on a context of their own."""

    def __init__(self, context: zmq.Context[Any], pub: zmq.Socket[Any], replay: zmq.Socket[Any] | None):
        self.context, self.pub, self.replay = context, pub, replay

    @classmethod
    def open(cls, config: EventsConfig, zmq: Any) -> Sockets:
        context = zmq.Context()
        sockets: list[Any] = []
        try:
            pub = context.socket(zmq.PUB)
            sockets.append(pub)
            pub.setsockopt(zmq.SNDHWM, config.high_water_mark)
            pub.setsockopt(zmq.LINGER, 0)
            _attach(pub, config.endpoint, connect=config.connect, what="kv_events endpoint")
            replay = None
            if config.replay_endpoint:
                replay = context.socket(zmq.ROUTER)
                sockets.append(replay)
                replay.setsockopt(zmq.LINGER, 0)
                _attach(replay, config.replay_endpoint, connect=False, what="kv_events replay endpoint")
        except BaseException:
            for sock in sockets:
                sock.close(0)
            context.term()
            raise
        return cls(context, pub, replay)

    def close(self) -> None:
        self.pub.close(0)
        if self.replay is not None:
            self.replay.close(0)
        self.context.term()


def _attach(sock: Any, endpoint: str, *, connect: bool, what: str) -> None:
    import zmq

    try:
        sock.connect(endpoint) if connect else sock.bind(endpoint)
    except zmq.ZMQError as exc:
        verb = "connect to" if connect else "bind"
        raise InvalidInputError(f"{what}: cannot {verb} {endpoint!r}: {exc}") from exc


class Publisher:
    """A `kvstore.index.listener.BlockListener` that publishes KV events from a thread.

    Made by `open_publisher`; `close` stops the thread and closes the sockets.
    """

    def __init__(
        self, config: EventsConfig, sockets: Sockets, *, store: WatchedStore, first_seq: int | None = None
    ) -> None:
        from kvstore.events import wire
        from kvstore.events.view import RouterView

        self.config = config
        self._wire = wire
        self._sockets = sockets
        self._store = store  # read afresh when news was dropped
        self._topic = config.topic.encode()
        self._queue: queue.Queue[tuple[str, Sequence[Any]]] = queue.Queue(config.queue_size)
        self._resync = threading.Event()  # news was dropped: publish a fresh snapshot
        self._view = RouterView(config.medium, config.router_block_tokens)
        self._start: tuple[list[BlockMeta], set[bytes]] = ([], set())
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.replay_batches)
        self._encoder = wire_encoder()
        # A restarted sidecar must continue above its last number: routers drop older ones.
        self._next_seq = time.time_ns() // 1000 if first_seq is None else first_seq
        self._counts = {"batches": 0, "events": 0, "dropped": 0, "resyncs": 0, "replays": 0}
        self._stopping = threading.Event()
        self._last_batch_s = 0.0  # monotonic time of the last batch with news
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)

    # -- BlockListener (store threads: never block) ----------------------------------

    def blocks_listed(self, metas: Sequence[BlockMeta]) -> None:
        self._offer("listed", metas)

    def blocks_unlisted(self, metas: Sequence[BlockMeta]) -> None:
        self._offer("unlisted", metas)

    def blocks_in_memory(self, metas: Sequence[BlockMeta]) -> None:
        self._offer("in_memory", metas)

    def blocks_out_of_memory(self, keys: Sequence[bytes]) -> None:
        self._offer("out_of_memory", keys)

    def _offer(self, news: str, items: Sequence[Any]) -> None:
        try:
            self._queue.put_nowait((news, items))
        except queue.Full:
            self._counts["dropped"] += len(items)  # a lost increment only undercounts drops
            self._resync.set()

    # -- life -----------------------------------------------------------------------

    def start(self, listed: list[BlockMeta], in_memory: set[bytes]) -> None:
        """Publish a clear and the store's blocks (`listed`, parents first; `in_memory`, those
        held whole in memory), then follow the queue."""
        self._start = (listed, in_memory)
        self._thread.start()

    def close(self, timeout_s: float = 5.0) -> None:
        """Publish what is queued (for up to `timeout_s`), stop the thread, close the sockets."""
        self._stopping.set()
        if self._thread.ident is not None:  # started
            self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("kv-events thread did not stop within %.1f s", timeout_s)
            return
        self._sockets.close()

    def stats(self) -> PublisherStats:
        counts = self._counts
        return PublisherStats(
            counts["batches"], counts["events"], counts["dropped"], counts["resyncs"], counts["replays"],
            self._queue.qsize(), self._next_seq - 1,
        )  # fmt: skip

    @property
    def closed(self) -> bool:
        return self._stopping.is_set() and not self._thread.is_alive()

    # -- the publishing thread ---------------------------------------------------------

    def _run(self) -> None:
        try:
            self._send(self._view.reset(*self._start))
            last_sent = time.monotonic()
            while not (self._stopping.is_set() and self._queue.empty()):
                self._serve_replay()
                if self._resync.is_set():
                    self._resync_now()
                    last_sent = time.monotonic()
                    continue
                events = self._next_events(timeout_s=0.02)
                now = time.monotonic()
                if events or now - last_sent >= self.config.heartbeat_s:
                    self._send(events)
                    last_sent = now
        except Exception:  # the store goes on without events; say so once, loudly
            log.exception("kv-events publisher stopped")

    def _next_events(self, timeout_s: float) -> list[wire.Event]:
        """The events of the news queued now (waiting up to `timeout_s` for the first)."""
        try:
            items = [self._queue.get(timeout=timeout_s)]
        except queue.Empty:
            return []
        if time.monotonic() - self._last_batch_s < BURST_GAP_S:
            time.sleep(LINGER_S)
        with contextlib.suppress(queue.Empty):
            while len(items) < 4096:
                items.append(self._queue.get_nowait())
        view = self._view
        apply: dict[str, Callable[[Any], Iterable[wire.Event]]] = {
            "listed": view.listed, "unlisted": view.unlisted,
            "in_memory": view.in_memory, "out_of_memory": view.out_of_memory,
        }  # fmt: skip
        events: list[wire.Event] = []
        for news, payload in items:
            events.extend(apply[news](payload))
        return events

    def _resync_now(self) -> None:
        """News was dropped: forget the queue, read the store afresh, publish a snapshot."""
        self._resync.clear()
        with contextlib.suppress(queue.Empty):
            while True:
                self._queue.get_nowait()
        self._counts["resyncs"] += 1
        self._send(self._view.reset(self._store.listed_blocks(), self._store.keys_in_memory()))

    def _send(self, events: list[wire.Event]) -> None:
        seq = self._next_seq
        self._next_seq += 1
        payload = self._encode(events)
        self._sockets.pub.send_multipart((self._topic, self._wire.encode_seq(seq), payload))
        self._buffer.append((seq, payload))
        self._counts["batches"] += 1
        if events:
            self._last_batch_s = time.monotonic()
        self._counts["events"] += len(events)

    def _encode(self, events: list[wire.Event]) -> bytes:
        batch = self._wire.EventBatch(ts=time.time(), events=events, data_parallel_rank=0)
        return bytes(self._encoder.encode(batch))

    def _serve_replay(self) -> None:
        """Answer every waiting replay request (a ROUTER never blocks on a send)."""
        replay = self._sockets.replay
        while replay is not None and replay.poll(0):
            frames = replay.recv_multipart()
            self._counts["replays"] += 1
            client = frames[0]
            try:
                if len(frames) != 3:
                    raise ValueError(f"a replay request is [identity, b'', seq], got {len(frames)} frames")
                start = self._wire.decode_seq(frames[2])
            except ValueError as exc:
                log.warning("kv-events: bad replay request: %s", exc)
                replay.send_multipart((client, b"", b"", self._wire.END_SEQ, b""))
                continue
            for seq, payload in self._replay_batches(start):
                replay.send_multipart((client, b"", self._topic, self._wire.encode_seq(seq), payload))
            replay.send_multipart((client, b"", b"", self._wire.END_SEQ, b""))

    def _replay_batches(self, start: int) -> list[tuple[int, bytes]]:
        """The batches from `start` on; a snapshot when `start` is older than the buffer."""
        last = self._next_seq - 1
        if start > last:
            return []
        if self._buffer and start >= self._buffer[0][0]:
            return [(seq, payload) for seq, payload in self._buffer if seq >= start]
        return [(last, self._encode(self._view.snapshot()))]


def wire_encoder() -> Any:
    """msgspec's msgpack encoder (the one vLLM uses)."""
    import msgspec

    return msgspec.msgpack.Encoder()
