"""The replay socket (ZMQ ROUTER): routers ask for the batches they missed; bounded work.

A request is `[b"", start_seq]` from a DEALER or REQ; the answer is what `History.answer`
gives (buffered batches, or a shared snapshot and the batches after it), each
`[b"", topic, seq, payload]`, then the end marker `[b"", b"", -1, b""]`.

Nothing a client does can make this thread work without bound, because its time is taken from
the storing threads (the GIL; kvstore/events/publisher.py):

- requests are read at most `replay_intake_rate` a second (all clients together); the rest wait
  in ZMQ's queues, whose high-water marks stop a client that sends faster;
- a request is answered in full at most `replay_client_rate` a second per client (ROUTER
  identity, a burst of `replay_client_burst`) and `replay_total_rate` a second in all (a burst
  of `replay_total_burst`); over either bound, or when its snapshot would pass the building
  budget (kvstore/events/history.py), it gets the end marker alone and is counted
  (`refused`, `kvsieve_kv_events_replays_refused`). A router that got the end marker alone
  still misses batches: it asks again on the next gap it sees;
- an answer is at most `history.TAIL_MAX` + 1 messages, and sending never blocks (a ROUTER
  drops what a client that does not read has no room for).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvstore.events.config import EventsConfig
from kvstore.events.history import History

if TYPE_CHECKING:  # msgspec, the `events` extra: kvstore (and `kvsieve serve`) run without it
    pass

log = logging.getLogger(__name__)
#: Clients remembered for their per-client bound; past it, those with a full allowance go.
MAX_CLIENTS = 4096


class Allowance:
    """A token bucket: `burst` at most, refilled at `rate` a second."""

    __slots__ = ("level", "stamp")

    def __init__(self, burst: float, now: float) -> None:
        self.level, self.stamp = burst, now

    def refill(self, rate: float, burst: float, now: float) -> float:
        self.level = min(burst, self.level + (now - self.stamp) * rate)
        self.stamp = now
        return self.level


class ReplayServer:
    """Answers replay requests on `socket` from `history`, within the bounds of `config`."""

    def __init__(
        self, socket: Any, config: EventsConfig, topic: bytes, history: History,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:  # fmt: skip
        import zmq

        from kvstore.events import wire  # here: only a publisher with a replay socket needs it

        self._wire = wire
        self._socket, self._config, self._topic, self._history = socket, config, topic, history
        self._clock, self._again = clock, zmq.Again
        self._nonblocking = zmq.NOBLOCK
        now = clock()
        self._intake = Allowance(_burst_of(config.replay_intake_rate), now)
        self._total = Allowance(config.replay_total_burst, now)
        self._clients: dict[bytes, Allowance] = {}
        self.requests = 0  # requests read (answered in full, refused or malformed)
        self.refused = 0  # requests answered with the end marker alone: over a bound

    def serve(self) -> None:
        """Answer the requests waiting now, as many as the intake allows."""
        rate, now = self._config.replay_intake_rate, self._clock()
        allowed = int(self._intake.refill(rate, _burst_of(rate), now))
        for _ in range(allowed):
            try:
                frames = self._socket.recv_multipart(self._nonblocking)
            except self._again:
                return
            self._intake.level -= 1
            self.requests += 1
            self._answer(frames, now)

    def _answer(self, frames: list[bytes], now: float) -> None:
        client = frames[0]
        try:
            if len(frames) != 3:
                raise ValueError(f"a replay request is [identity, b'', seq], got {len(frames)} frames")
            start = self._wire.decode_seq(frames[2])
        except ValueError as exc:
            log.warning("kv-events: bad replay request: %s", exc)
            return self._end(client)
        if start > self._history.last:
            return self._end(client)  # nothing that new: costs nothing, needs no allowance
        batches = self._history.answer(start) if self._admit(client, now) else None
        if batches is None:
            self.refused += 1
            return self._end(client)
        send = self._socket.send_multipart
        for seq, payload in batches:
            send((client, b"", self._topic, self._wire.encode_seq(seq), payload))
        self._end(client)

    def _admit(self, client: bytes, now: float) -> bool:
        """Take one answer from the client's allowance and the total's (both, or neither)."""
        config = self._config
        mine = self._clients.get(client)
        if mine is None:
            if len(self._clients) >= MAX_CLIENTS:
                self._forget_idle_clients(now)
            mine = self._clients[client] = Allowance(config.replay_client_burst, now)
        if mine.refill(config.replay_client_rate, config.replay_client_burst, now) < 1:
            return False
        if self._total.refill(config.replay_total_rate, config.replay_total_burst, now) < 1:
            return False
        mine.level -= 1
        self._total.level -= 1
        return True

    def _forget_idle_clients(self, now: float) -> None:
        """Drop the clients whose allowance is full again (nothing to remember); if none is,
        the oldest half (they then start with a full allowance: the total bound still holds)."""
        rate, burst = self._config.replay_client_rate, self._config.replay_client_burst
        clients = self._clients
        idle = [client for client, mine in clients.items() if mine.refill(rate, burst, now) >= burst]
        for client in idle or list(clients)[: len(clients) // 2]:
            del clients[client]

    def _end(self, client: bytes) -> None:
        self._socket.send_multipart((client, b"", b"", self._wire.END_SEQ, b""))


def _burst_of(rate: float) -> float:
    """The intake's burst: a fiftieth of a second's worth (the publisher looks every ~20 ms)."""
    return max(1.0, rate / 50)
