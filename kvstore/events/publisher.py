"""The KV-event publisher: store threads queue news, one thread publishes it over ZMQ.

Never in the way of a store or a load: a store's thread only appends a reference to the
index's news to a bounded inbox (kvstore/events/inbox.py: no lock, no wake-up in a burst);
when it is full the news is dropped and counted, and the publisher publishes a fresh snapshot
(`AllBlocksCleared`, then every block) once it has caught up, so a subscriber's view is right
again. Everything else (router hashes, token lists, msgpack, ZMQ) happens on the publisher's
thread, which in Python still takes the GIL from the storing threads: it wakes as little as it
can (one batch per burst of stores) and bounds what replay requests may make it do
(kvstore/events/replay.py). The PUB socket drops messages for a subscriber that does not read
past its high-water mark (ZMQ's own rule), so a stalled subscriber costs nothing either.

What a subscriber sees:

- sequence numbers without gaps within a run; a run starts at the microseconds since the epoch,
  so a restarted sidecar continues above where it was (a router drops a batch whose sequence
  number is below one it has seen) and the jump tells it to ask for a replay;
- first an `AllBlocksCleared` and a `BlockStored` for every listed block (the snapshot);
- then a `BlockStored` per newly listed block and a `BlockRemoved` per unlisted one; and an
  empty batch after `heartbeat_s` without news, so a router that (re)started late notices the
  sequence it missed at once and asks for a replay;
- on the replay socket, the batches from the asked sequence on, from a buffer of the last
  `replay_batches`; a sequence older than the buffer (or too far back) is answered with a
  snapshot shared by every request for that state, numbered as the batch it describes, and the
  batches after it (kvstore/events/history.py), never a hang.

What was announced is kept by a `RouterView` (kvstore/events/view.py: references to the blocks'
metadata, no copy), which this thread alone touches: a snapshot it sends is exact at the
sequence number it carries.
"""

from __future__ import annotations

import itertools
import logging
import operator
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from kvstore.errors import InvalidInputError
from kvstore.events.config import EventsConfig
from kvstore.events.history import History
from kvstore.events.inbox import Inbox
from kvstore.events.replay import ReplayServer
from kvstore.format.block_meta import BlockMeta

if TYPE_CHECKING:
    import zmq

    from kvstore.events import wire

log = logging.getLogger(__name__)
# After a batch with news the publisher sleeps (lingers) before it looks again, so that a burst of
# stores is a few batches: each batch costs this thread hundreds of us beyond its blocks', mostly
# taking the GIL back from the storing threads after each call that let it go (a sleep or a wait,
# each ZMQ frame sent, the replay socket's look). The linger starts at LINGER_MIN_S, so that the
# rest of one Store (a prompt of several blocks) follows its first block within a ms or two, and
# doubles while news keeps coming up to LINGER_MAX_S, the most a block waits in a sustained burst
# (measured on memory-only stores of 0.6 ms, interleaved rounds: 0.86-0.90 of the store rate
# without events with 20 ms, 0.81-1.00 (median 0.96) with 50 ms, none clear at 100 ms). A burst sleeps once
# a batch and never waits on the wake-up event as well. News after a quiet spell goes at once.
LINGER_MIN_S = 0.001
LINGER_MAX_S = 0.05
#: Longest sleep while idle: replay requests are looked at this often.
IDLE_WAIT_S = 0.02
#: What the replay socket holds of requests not read yet (messages per client, kernel bytes):
#: small, so that a client that sends faster than they are read is stopped by its own socket
#: soon, and little is left to read once it stops (kvstore/events/replay.py).
REPLAY_RCVHWM = 64
REPLAY_RCVBUF = 1 << 16
#: News items (one per index change) made into one batch at most.
MAX_BATCH_ITEMS = 4096
_NEWS_KIND = operator.itemgetter(0)


@dataclass(frozen=True)
class PublisherStats:
    """What the publisher did since it started (counters) and where it is (last_seq, queued)."""

    batches: int
    events: int
    dropped: int
    resyncs: int
    replays: int  # replay requests read
    queued: int
    last_seq: int
    replays_refused: int = 0  # replay requests answered with the end marker alone (a bound)
    snapshots: int = 0  # snapshots built for replay answers


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
                replay.setsockopt(zmq.RCVHWM, REPLAY_RCVHWM)
                replay.setsockopt(zmq.RCVBUF, REPLAY_RCVBUF)
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
        self._inbox = Inbox(config.queue_size)
        self._view = RouterView(config.medium, config.router_block_tokens)
        self._apply: dict[str, Callable[[Any], list[wire.Event]]] = {
            "listed": self._view.listed, "unlisted": self._view.unlisted,
            "in_memory": self._view.in_memory, "out_of_memory": self._view.out_of_memory,
        }  # fmt: skip
        self._start: tuple[list[BlockMeta], set[bytes]] = ([], set())
        self._history = History(config.replay_batches, self._encode_snapshot)
        self._replay = (
            None if sockets.replay is None
            else ReplayServer(sockets.replay, config, self._topic, self._history)
        )  # fmt: skip
        self._encoder = wire_encoder()
        # A restarted sidecar must continue above its last number: routers drop older ones.
        self._next_seq = time.time_ns() // 1000 if first_seq is None else first_seq
        self._counts = {"batches": 0, "events": 0, "resyncs": 0}
        self._stopping = threading.Event()
        self._last_sent_s = 0.0  # monotonic time of the last batch
        self._linger_s = LINGER_MIN_S
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)

    # -- BlockListener (store threads: never block) ----------------------------------

    def blocks_listed(self, metas: Sequence[BlockMeta]) -> None:
        self._inbox.offer("listed", metas)

    def blocks_unlisted(self, metas: Sequence[BlockMeta]) -> None:
        self._inbox.offer("unlisted", metas)

    def blocks_in_memory(self, metas: Sequence[BlockMeta]) -> None:
        self._inbox.offer("in_memory", metas)

    def blocks_out_of_memory(self, keys: Sequence[bytes]) -> None:
        self._inbox.offer("out_of_memory", keys)

    # -- life -----------------------------------------------------------------------

    def start(self, listed: list[BlockMeta], in_memory: set[bytes]) -> None:
        """Publish a clear and the store's blocks (`listed`, parents first; `in_memory`, those
        held whole in memory), then follow the news."""
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
        counts, replay = self._counts, self._replay
        return PublisherStats(
            counts["batches"], counts["events"], self._inbox.dropped, counts["resyncs"],
            replay.requests if replay else 0, len(self._inbox), self._next_seq - 1,
            replay.refused if replay else 0, self._history.builds,
        )  # fmt: skip

    @property
    def closed(self) -> bool:
        return self._stopping.is_set() and not self._thread.is_alive()

    # -- the publishing thread ---------------------------------------------------------

    def _run(self) -> None:
        try:
            self._publish(self._view.reset(*self._start), snapshot=True)
            while not (self._stopping.is_set() and not len(self._inbox)):
                self._step()
        except Exception:  # the store goes on without events; say so once, loudly
            log.exception("kv-events publisher stopped")

    def _step(self) -> None:
        """Answer replays, then publish the news waiting (or a heartbeat, or sleep)."""
        if self._replay is not None:
            self._replay.serve()
        inbox = self._inbox
        if inbox.overflowed:
            self._resync_now()
            return
        if len(inbox):
            events: list[wire.Event] = []
            # news of one kind in a row (a burst of stores: one item per block) in one call
            for news, run in itertools.groupby(inbox.take(MAX_BATCH_ITEMS), key=_NEWS_KIND):
                events += self._apply[news]([item for _, items in run for item in items])
            self._publish(events)
            if events and not self._stopping.is_set():
                time.sleep(self._linger_s)  # a burst may go on: let its next news gather
                more = len(inbox) > 0
                self._linger_s = min(2 * self._linger_s, LINGER_MAX_S) if more else LINGER_MIN_S
            return
        until_heartbeat = self._last_sent_s + self.config.heartbeat_s - time.monotonic()
        if until_heartbeat <= 0:
            self._publish([])
        elif not self._stopping.is_set():
            inbox.wait(min(IDLE_WAIT_S, until_heartbeat))  # the first news wakes it: published at once

    def _resync_now(self) -> None:
        """News was dropped: forget the inbox, read the store afresh, publish a snapshot."""
        self._inbox.clear()  # first: news dropped while the store is read calls for another
        self._counts["resyncs"] += 1
        snapshot = self._view.reset(self._store.listed_blocks(), self._store.keys_in_memory())
        self._publish(snapshot, snapshot=True)

    def _publish(self, events: list[wire.Event], *, snapshot: bool = False) -> None:
        seq = self._next_seq
        self._next_seq += 1
        payload = self._encode(events)
        self._view.batch_done()
        self._sockets.pub.send_multipart((self._topic, self._wire.encode_seq(seq), payload))
        self._history.append(seq, payload, is_snapshot=snapshot)
        self._counts["batches"] += 1
        self._last_sent_s = time.monotonic()
        self._counts["events"] += len(events)

    def _encode_snapshot(self) -> bytes:
        payload = self._encode(self._view.snapshot())
        self._view.batch_done()
        return payload

    def _encode(self, events: list[wire.Event]) -> bytes:
        batch = self._wire.EventBatch(ts=time.time(), events=events, data_parallel_rank=0)
        return bytes(self._encoder.encode(batch))


def wire_encoder() -> Any:
    """msgspec's msgpack encoder (the one vLLM uses)."""
    import msgspec

    return msgspec.msgpack.Encoder()
