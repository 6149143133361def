"""What each plan took when it ran: `PlanLog`, the measurements that decide over estimates.

The engine records, after every request, the seconds from the start of its prefill to its first
logits under the plan it ran and where the request stood (engine_adapter/runner/plans.py `Key`).
A plan's measured time at a key is the least per prompt token of its last `WINDOW` runs there,
scaled to the request's prompt:

- per prompt token, because requests filed under one key differ in length by up to 2x;
- the least, because a run is slowed by what else the machine does and never sped up by it: one
  slow run (another process's burst, a first run's warm-up) must not make the plan that usually
  wins look worse than its rival;
- of the last few runs, because the machine drifts (a disk filling up, another tenant on the GPU):
  a plan that keeps running is measured again each time, and once its last `WINDOW` runs are all
  slower, so is its value. A plan that stopped running keeps what it measured: no estimate, and no
  age, ever makes a plan measured slower than another look faster than it again.
"""

from __future__ import annotations

from collections import deque

from engine_adapter.runner.plans import Key

#: Runs of one plan at one key that its value is the least of.
WINDOW = 4


class PlanLog:
    """Measured seconds per plan and key (module docstring). Not thread-safe (one engine's requests)."""

    def __init__(self, window: int = WINDOW) -> None:
        self._window = window
        self._runs: dict[Key, deque[float]] = {}

    def record(self, key: Key, prompt_tokens: int, seconds: float) -> None:
        """A run filed under `key`, over a prompt of `prompt_tokens`, took `seconds`."""
        if prompt_tokens <= 0 or seconds <= 0:
            return
        runs = self._runs.get(key)
        if runs is None:
            runs = self._runs[key] = deque(maxlen=self._window)
        runs.append(seconds / prompt_tokens)

    def seconds(self, key: Key, prompt_tokens: int) -> float | None:
        """The plan's measured seconds at `key`, for a prompt of `prompt_tokens`; None if never run."""
        runs = self._runs.get(key)
        return None if not runs else min(runs) * prompt_tokens

    def runs(self, key: Key) -> int:
        """How many runs at `key` the value is made of (at most `WINDOW`)."""
        runs = self._runs.get(key)
        return 0 if runs is None else len(runs)
