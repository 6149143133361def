"""SidecarGuard: calls to the sidecar that can fail without failing a request.

Every failure (unreachable, deadline, corrupt data, a bug of ours) turns into "no
result": vLLM then computes what it could not load, or simply does not save.
After a failure the guard skips calls for `retry_after_s`, so a dead sidecar
costs one deadline per outage instead of one per request, and it logs one
warning per outage (and one line when the sidecar answers again).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

logger = logging.getLogger("kvsieve.vllm")


class SidecarGuard:
    """Runs sidecar calls behind a circuit breaker. Thread-safe (the worker's loads and its
    sender thread's stores share one, so an outage is warned about once).

    Args:
        retry_after_s: how long calls are skipped after a failure.
        clock: monotonic seconds (injectable for tests).
        log: where the per-outage warning goes (public: the worker logs there too).
    """

    def __init__(
        self,
        retry_after_s: float,
        clock: Callable[[], float] = time.monotonic,
        log: logging.Logger = logger,
    ) -> None:
        self._retry_after_s = retry_after_s
        self._clock = clock
        self.log = log
        self._lock = threading.Lock()  # held for the breaker's state, never during a call
        self._skip_until = float("-inf")
        self._failing = False
        self.failures = 0
        self.skipped = 0

    @property
    def available(self) -> bool:
        """False while calls are being skipped after a failure."""
        return self._clock() >= self._skip_until

    def call(self, what: str, fn: Callable[[], T]) -> T | None:
        """`fn()`, or None if it raised or the breaker is open.

        Args:
            what: the operation, for the log ("lookup", "load", "store").
            fn: the call to make.
        """
        with self._lock:
            if not self.available:
                self.skipped += 1
                return None
        try:
            result = fn()
        except Exception as exc:
            self._fail(what, exc)
            return None
        with self._lock:
            recovered, self._failing = self._failing, False
        if recovered:
            self.log.info("kvsieve sidecar answers again (%s succeeded)", what)
        return result

    def _fail(self, what: str, exc: Exception) -> None:
        with self._lock:
            self.failures += 1
            self._skip_until = self._clock() + self._retry_after_s
            first, self._failing = not self._failing, True
        if first:
            self.log.warning(
                "kvsieve sidecar %s failed (%s: %s): vLLM computes instead of loading; "
                "next try in %.0f s, no further warning until it answers",
                what,
                type(exc).__name__,
                exc,
                self._retry_after_s,
            )
