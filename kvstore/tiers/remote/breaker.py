"""A circuit breaker for the remote tier: stop calling a server that keeps failing.

While the remote tier is down, every call would wait for its timeout; the breaker
turns that into an immediate miss. States:

- closed: calls go through; `failure_threshold` failures in a row open it.
- open: calls are refused (no network) until `retry_after` has passed.
- half-open: one probe call at a time is let through. Success closes the breaker;
  failure opens it again with the wait doubled (up to `max_backoff_s`), so a dead
  server is retried with exponential backoff rather than hammered.

The clock is injected (`clock`, seconds, monotonic) so that tests drive time
instead of sleeping.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from enum import IntEnum
from typing import NamedTuple


class BreakerState(IntEnum):
    """The breaker's state; the integer is what the metrics gauge shows."""

    CLOSED = 0
    OPEN = 1
    HALF_OPEN = 2


class BreakerSnapshot(NamedTuple):
    """State and totals of a breaker at one instant."""

    state: BreakerState
    opens: int
    closes: int
    refused: int
    backoff_s: float


class CircuitBreaker:
    """See module docstring. Thread-safe."""

    def __init__(
        self,
        failure_threshold: int = 3,
        reset_s: float = 1.0,
        max_backoff_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if failure_threshold < 1 or reset_s <= 0 or max_backoff_s < reset_s:
            raise ValueError(
                "breaker needs failure_threshold >= 1 and 0 < reset_s <= max_backoff_s, got "
                f"{failure_threshold}, {reset_s}, {max_backoff_s}"
            )
        self._threshold = failure_threshold
        self._reset_s = reset_s
        self._max_backoff_s = max_backoff_s
        self._clock = clock
        self._lock = threading.Lock()
        self._state = BreakerState.CLOSED
        self._failures = 0
        self._backoff_s = reset_s
        self._retry_at = 0.0
        self._probing = False
        self._opens = self._closes = self._refused = 0

    def allow(self) -> bool:
        """Whether a call may go out now. In half-open, True for one probe at a time.

        A caller that got True must report the outcome with `success` or `failure`.
        """
        with self._lock:
            if self._state is BreakerState.CLOSED:
                return True
            if self._state is BreakerState.OPEN and self._clock() >= self._retry_at:
                self._state = BreakerState.HALF_OPEN
            if self._state is BreakerState.HALF_OPEN and not self._probing:
                self._probing = True
                return True
            self._refused += 1
            return False

    def success(self) -> None:
        """Report a call that worked: resets the failure count, closes a half-open breaker."""
        with self._lock:
            self._failures = 0
            if self._state is not BreakerState.CLOSED:
                self._state = BreakerState.CLOSED
                self._backoff_s = self._reset_s
                self._probing = False
                self._closes += 1

    def failure(self) -> None:
        """Report a call that failed (error or timeout)."""
        with self._lock:
            self._failures += 1
            if self._state is BreakerState.HALF_OPEN:
                self._backoff_s = min(self._backoff_s * 2, self._max_backoff_s)
                self._open()
            elif self._state is BreakerState.CLOSED and self._failures >= self._threshold:
                self._open()

    def snapshot(self) -> BreakerSnapshot:
        """Current state and totals."""
        with self._lock:
            return BreakerSnapshot(self._state, self._opens, self._closes, self._refused, self._backoff_s)

    def _open(self) -> None:
        self._state = BreakerState.OPEN
        self._retry_at = self._clock() + self._backoff_s
        self._probing = False
        self._opens += 1
